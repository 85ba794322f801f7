"""The numerical oracle: transformers on tiny random models of each architecture.

Each model is built in transformers, converted with `moe-pipe convert`, and
run through moe-pipe's forward pass: last-position logits must match within
1e-4 relative (f32) and greedy continuations must be identical. Needs torch
and transformers (the `oracle` extra); skipped with the reason when absent.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
pytest.importorskip("transformers", reason="oracle tests need transformers (pip install '.[oracle]')")

from moe_pipe.shared.convert.converter import convert  # noqa: E402
from moe_pipe.shared.gguf.model_file import open_model  # noqa: E402
from moe_pipe.shared.model.load import load_model  # noqa: E402

from . import hfmodels  # noqa: E402

PROMPTS = [
    list(range(3, 40, 3)),
    [5, 17, 2, 99, 140, 7, 7, 7, 30],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
]
N_GREEDY = 32


@pytest.fixture(scope="module", params=hfmodels.ARCHES)
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = hfmodels.build(request.param, root / "hf")
    ref = hfmodels.load_model(hf_dir)
    ggufs = {t: convert(hf_dir, root / f"m-{t}.gguf", outtype=t) for t in ("f32", "q8_0")}
    return request.param, ref, ggufs


def ours_greedy(model, ids, n):
    cache = model.new_cache(len(ids) + n + 1)
    logits, out = model.prefill(ids, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_one(out[-1], cache)
    return out


@pytest.mark.oracle
def test_f32_logits_and_greedy_match_transformers(pair):
    arch, ref, ggufs = pair
    with open_model(ggufs["f32"]) as mf:
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)[-1]
            got = model.forward(ids, model.new_cache(64))[-1]
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{arch}: last-position logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
            assert ours_greedy(model, ids, N_GREEDY) == hfmodels.hf_greedy(ref, ids, N_GREEDY), f"{arch}: greedy tokens differ"


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.oracle
def test_q8_0_stays_close(pair, capsys):
    """q8_0 is lossy: the logit error is reported, and greedy output must agree
    for its first tokens on most prompts (random tiny models have near-tied
    logits, so long continuations may part ways)."""
    arch, ref, ggufs = pair
    prefixes, errs = [], []
    with open_model(ggufs["q8_0"]) as mf:
        model = load_model(mf)
        for ids in PROMPTS:
            want = hfmodels.hf_logits(ref, ids)[-1]
            got = model.forward(ids, model.new_cache(64))[-1]
            errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
            prefixes.append(common_prefix(ours_greedy(model, ids, 8), hfmodels.hf_greedy(ref, ids, 8)))
    with capsys.disabled():
        print(
            f"\n{arch} q8_0: max relative logit error {max(errs):.2e}; greedy tokens agreeing before the first difference (of 8): {prefixes}"
        )
    assert max(errs) < 0.1
    assert sum(p >= 3 for p in prefixes) >= 2, prefixes


MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln: Äpfel, Öl und Übermut — 100 % ß.",
    "我们今天去公园散步，天气很好。",
    "Emoji: 🙂🚀 and café, naïve, São Paulo.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Numbers: 3.14159, 2024-11-30, 1234567890",
    "   leading spaces\tand tabs\r\nwindows newline",
]


@pytest.fixture(scope="module")
def hf_tokenizer(pair):
    from transformers import AutoTokenizer

    arch, ref, ggufs = pair
    return AutoTokenizer.from_pretrained(ref.name_or_path)


@pytest.mark.oracle
def test_tokenizer_matches_transformers(pair, hf_tokenizer):
    from moe_pipe.shared.text.tokenizer import Tokenizer

    arch, _, ggufs = pair
    with open_model(ggufs["f32"]) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
    for text in MULTILINGUAL:
        want = hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_bos=False) == want, f"{arch}: {text!r}"
        assert tok.decode(want) == hf_tokenizer.decode(want), f"{arch}: {text!r}"


@pytest.mark.oracle
def test_chat_template_matches_transformers(pair, hf_tokenizer):
    from moe_pipe.shared.text.chat import render_chat

    arch, _, ggufs = pair
    conversations = [
        [{"role": "user", "content": "Hello! How are you?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
    ]
    with open_model(ggufs["f32"]) as mf:
        for messages in conversations:
            want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert render_chat(mf.gguf, messages, add_generation_prompt=True) == want, arch


@pytest.mark.oracle
def test_llama_cpp_greedy_tokens_match_ours(pair):
    """The same converted GGUF through llama.cpp: the GGUF conventions, not just the math."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra)")
    arch, _, ggufs = pair
    llm = llama_cpp.Llama(str(ggufs["f32"]), n_ctx=128, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False)
    try:
        with open_model(ggufs["f32"]) as mf:
            model = load_model(mf)
            for ids in PROMPTS:
                llm.reset()
                llm.eval(ids)
                theirs = []
                for _ in range(16):
                    theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([theirs[-1]])
                assert ours_greedy(model, ids, 16) == theirs, f"{arch}: greedy tokens differ from llama.cpp"
    finally:
        llm.close()
