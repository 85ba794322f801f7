"""Tokenizer from GGUF metadata: round trips, special tokens, BOS, streaming,
end-of-generation ids, and (oracle) the same ids as llama.cpp on the same file."""

from __future__ import annotations

import random

import pytest

from moe_pipe.shared.errors import GGUFError
from moe_pipe.shared.gguf.reader import GGUFFile
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.text.tokenizer import BYTE, CONTROL, NORMAL, USER_DEFINED, Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")

# No "▁" (U+2581): SPM-style tokenizers (gemma4) read it as a space, as llama.cpp does.
SAMPLE = (
    "Hello, world! It's a test: don't, we'll, they've, I'M here.\n"
    "Grüße aus München: Äpfel, Öl und Übermut; die Straße ist naß.\n"
    "中文测试：你好，世界！我们今天学习分词。日本語とカタカナ。한국어 문장.\n"
    "Emoji: 😀👍🏽🇩🇪 and a family 👨‍👩‍👧 — done.\n"
    "def f(x):\n    return x**2  # comment\n\tif x >= 10_000: print(f'{x:,}')\n"
    "Digits 1234567890 3.14159 -42 1e-5 007\n"
    "   multiple    spaces   \n\n\n\nnewlines\r\nand   trailing  "
)

CONTROL_TOKENS = {
    "qwen3moe": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    "gpt-oss": ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>"],
    "gemma4": ["<|turn>", "<turn|>", "<bos>", "<|channel>", "<channel|>"],
}
EOG_TEXTS = {
    "qwen3moe": {"<|im_end|>", "<|endoftext|>"},
    "gpt-oss": {"<|return|>", "<|call|>", "<|endoftext|>"},
    "gemma4": {"<turn|>", "<eos>"},
}
# llama.cpp re-types these harmony tokens as user-defined and then matches
# them even with special=False; we keep them control (see tokenizer.py).
LLAMA_CPP_HARMONY_RETYPED = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {arch: make_model(arch, "tiny", root / f"{arch}.gguf") for arch in ARCHS}


@pytest.fixture(scope="module")
def toks(model_paths):
    return {arch: Tokenizer.from_gguf(GGUFFile(p)) for arch, p in model_paths.items()}


def with_specials(arch: str) -> str:
    a, b = CONTROL_TOKENS[arch][:2]
    return f"{a}user\n{SAMPLE}{b}\n{a}assistant\n"


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("special", [True, False])
def test_round_trip_multilingual(toks, arch, special):
    tok = toks[arch]
    for text in (SAMPLE, with_specials(arch)):
        ids = tok.encode(text, add_bos=False, special=special)
        assert tok.decode(ids) == text
        assert tok.hf.decode(ids, skip_special_tokens=False) == text  # HF's decoder pipeline agrees


@pytest.mark.parametrize("arch", ARCHS)
def test_small_vocab_still_covers_every_byte(toks, arch):
    text = "\x00\x01\x7f\u00ff\u0100\uffff\U0010ffff\u200b"
    tok = toks[arch]
    assert tok.decode(tok.encode(text, add_bos=False)) == text


# --- special tokens ----------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_control_tokens_are_single_ids_only_with_special(toks, arch):
    tok = toks[arch]
    for text in CONTROL_TOKENS[arch]:
        ids = tok.encode(text, add_bos=False, special=True)
        assert len(ids) == 1 and tok.token_text(ids[0]) == text and tok.is_special(ids[0])
        plain = tok.encode(text, add_bos=False, special=False)
        assert len(plain) > 1 and ids[0] not in plain
        assert tok.decode(plain) == text


def test_user_defined_tokens_match_whatever_special_says(toks):
    tok = toks["qwen3moe"]
    think = tok.encode("<think>", add_bos=False)
    assert len(think) == 1 and tok.token_type(think[0]) == USER_DEFINED
    assert tok.encode("<think>", add_bos=False, special=False) == think
    assert not tok.is_special(think[0])
    assert tok.decode(think, skip_special=True) == "<think>"  # shown in output, like llama.cpp


@pytest.mark.parametrize("arch", ARCHS)
def test_skip_special_drops_control_tokens(toks, arch):
    tok = toks[arch]
    ids = tok.encode(with_specials(arch), add_bos=False)
    text = tok.decode(ids, skip_special=True)
    assert not any(t in text for t in CONTROL_TOKENS[arch][:2])
    assert SAMPLE in text


# --- BOS ---------------------------------------------------------------------


@pytest.mark.parametrize("arch, default_bos", [("qwen3moe", False), ("gpt-oss", False), ("gemma4", True)])
def test_add_bos_follows_the_gguf_flag(toks, arch, default_bos):
    tok = toks[arch]
    plain = tok.encode("hi there", add_bos=False)
    assert tok.add_bos is default_bos
    assert tok.encode("hi there") == ([tok.bos_id] if default_bos else []) + plain
    assert tok.encode("hi there", add_bos=True) == [tok.bos_id] + plain
    assert plain[:1] != [tok.bos_id]


# --- streaming ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_decoder_equals_whole_decode_and_never_splits_a_char(toks, arch):
    tok = toks[arch]
    ids = tok.encode(with_specials(arch), add_bos=False)
    for skip in (False, True):
        stream = tok.stream(skip_special=skip)
        pieces = [stream.feed(i) for i in ids]
        rest = stream.flush()
        assert "".join(pieces) + rest == tok.decode(ids, skip_special=skip)
        assert rest == ""
        assert not any("\ufffd" in p for p in pieces)
    # the tiny vocab splits CJK/emoji into byte tokens: some feeds must hold text back
    assert any(p == "" for p in pieces)


def test_stream_flush_reports_an_unfinished_character(toks):
    tok = toks["qwen3moe"]
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) > 1
    stream = tok.stream()
    assert stream.feed_many(ids[:-1]) == ""
    assert stream.flush() == "\ufffd"


# --- metadata ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_ids_and_eog(toks, model_paths, arch):
    tok = toks[arch]
    f = GGUFFile(model_paths[arch])
    assert tok.n_vocab == len(f.meta("tokenizer.ggml.tokens"))
    assert tok.bos_id == f.meta("tokenizer.ggml.bos_token_id")
    assert tok.eos_id == f.meta("tokenizer.ggml.eos_token_id")
    assert tok.eos_id in tok.eog_ids
    assert EOG_TEXTS[arch] <= {tok.token_text(i) for i in tok.eog_ids}
    assert isinstance(tok.eog_ids, frozenset)
    assert tok.chat_template == f.meta("tokenizer.chat_template")
    with pytest.raises(ValueError):
        tok.token_text(tok.n_vocab)


def test_harmony_end_is_not_end_of_generation(toks):
    tok = toks["gpt-oss"]
    (end,) = tok.encode("<|end|>", add_bos=False)
    assert not tok.is_eog(end)  # the final answer follows the analysis message's <|end|>


# --- rules checked on hand-made vocabularies -----------------------------------


def _tiny(model="gemma4", pre="gemma4", tokens=(), types=None, merges=()):
    tokens = list(tokens)
    return Tokenizer(
        model=model,
        pre=pre,
        tokens=tokens,
        types=list(types or [NORMAL] * len(tokens)),
        merges=list(merges),
        bos_id=None,
        eos_id=None,
        pad_id=None,
        add_bos=False,
    )


def test_gemma4_newline_run_in_vocab_is_one_token_without_a_merge():
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = _tiny(tokens=["\n", "\n\n\n", "a", "b", "▁", "▁a", *byte_tokens], types=[NORMAL] * 6 + [BYTE] * 256, merges=["▁ a"])
    nl, nl3, a, b = 0, 1, 2, 3
    assert tok.encode("a\n\n\nb\n\nb") == [a, nl3, b, nl, nl, b]
    assert tok.encode(" a") == [5]
    assert tok.encode("é") == [6 + 0xC3, 6 + 0xA9]  # byte fallback
    assert tok.decode(tok.encode("a\n\n\nb é a")) == "a\n\n\nb é a"


def test_unknown_pre_and_model_are_clear_errors():
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre 'nonsense' is not supported"):
        _tiny(model="gpt2", pre="nonsense", tokens=["a"])
    with pytest.raises(GGUFError, match="tokenizer.ggml.model 'rwkv'"):
        _tiny(model="rwkv", pre="default", tokens=["a"])
    with pytest.raises(GGUFError, match="duplicate token"):
        _tiny(model="gpt2", pre="qwen2", tokens=["a", "b", "a"])
    with pytest.raises(GGUFError, match="merges"):
        _tiny(model="gpt2", pre="qwen2", tokens=["a", "b"], merges=["a b"])  # "ab" is not in the vocab


def test_control_tokens_do_not_leak_into_the_plain_tokenizer():
    tokens = [chr(c) for c in range(33, 127)] + ["<|x|>"]
    tok = _tiny(model="gpt2", pre="qwen2", tokens=tokens, types=[NORMAL] * 94 + [CONTROL])
    assert tok.encode("a<|x|>") == [tokens.index("a"), 94]
    assert 94 not in tok.encode("a<|x|>", special=False)


# --- oracle: llama.cpp on the same file ----------------------------------------


@pytest.fixture(scope="module")
def llama(model_paths):
    llama_cpp = pytest.importorskip("llama_cpp")
    return {arch: llama_cpp.Llama(str(p), vocab_only=True, verbose=False) for arch, p in model_paths.items()}


def _plain_for_llama_cpp(arch: str, text: str) -> str:
    if arch == "gpt-oss":
        for t in LLAMA_CPP_HARMONY_RETYPED:
            text = text.replace(t, "")
    return text


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_ids_equal_llama_cpp(toks, llama, arch):
    tok, ref = toks[arch], llama[arch]
    for text in (SAMPLE, with_specials(arch), "", " ", "\n", "  \n\n  x"):
        # llama-cpp-python's add_bos=True means "add what the model's flag asks for": our None
        for ours, theirs in ((False, False), (None, True)):
            assert tok.encode(text, add_bos=ours) == ref.tokenize(text.encode(), add_bos=theirs, special=True), (text, ours)
        plain = _plain_for_llama_cpp(arch, text)
        assert tok.encode(plain, add_bos=False, special=False) == ref.tokenize(plain.encode(), add_bos=False, special=False)


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_ids_equal_llama_cpp_on_random_text(toks, llama, arch):
    tok, ref = toks[arch], llama[arch]
    pool = list(
        "abcXYZ äöüßÄÖÜ中文字日本語한국어αβγДжЯ\u0301\u0915\u093f\u0e01'sS'LL'Ve 0123456789 \t\n\r  ,.;:!?/\\-_()[]{}<>|@#$%^&*+=~`\"😀👍🏽\u200dſ\u00a0\u3000"
    )
    pool += CONTROL_TOKENS[arch] + ["<think>", "\n\n", "    ", "[PAD1700]", "<unused5>", "<|reserved_1605|>"]
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 40)))
        assert tok.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False, special=True), text
        plain = _plain_for_llama_cpp(arch, text)
        assert tok.encode(plain, add_bos=False, special=False) == ref.tokenize(plain.encode(), add_bos=False, special=False), plain


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
def test_eog_ids_equal_llama_cpp(toks, llama, arch):
    import llama_cpp

    tok, ref = toks[arch], llama[arch]
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    assert tok.eog_ids == {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}


# --- build time on a real-size vocabulary (slow: opening the GGUF takes seconds) --


@pytest.mark.slow
def test_build_time_full_vocab(tmp_path):
    import time

    path = make_model("gemma4", "gemma26b-shape", tmp_path / "g.gguf", layers=1, sparse=True)
    f = GGUFFile(path)
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(f)  # includes decoding the metadata arrays
    assert time.perf_counter() - start < 1.5
    assert tok.n_vocab == 262144
