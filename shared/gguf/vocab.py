"""Real tokenizers for made models: BPE trained on shared/data/corpus.txt.

Made GGUFs carry a tokenizer that llama.cpp and our own loader can both run,
so every model gets a BPE trained with HF `tokenizers` on the bundled corpus,
using exactly the pre-split the GGUF's `tokenizer.ggml.pre` names
(docs/models.md § Tokenizers), and then the tokenizer's special tokens and
unused placeholders up to the preset's vocab size. One builder per tokenizer
kind, each `(size, n_bpe) -> Vocab`; a family's plan part picks its own
(shared/families/<family>/plan.py `vocab`).

Vocab layouts (ids):

    qwen_vocab     [BPE ... | pad | 26 Qwen added tokens | [PADn] ...]      gpt2 / "qwen2"
    harmony_vocab  [BPE ... | pad | 21 harmony specials  | <|reserved_n|> ] gpt2 / "gpt-4o"
    glm4_vocab     [BPE ... | 36 GLM-4.5 added tokens | [PADn] ...]         gpt2 / "glm4"
    gemma_vocab    [specials 0..107 | <0x00>..<0xFF> | BPE ... | <unusedn>]  gemma4 (SPM-style)
    llama_vocab    [<unk> <s> </s> | <0x00>..<0xFF> | pieces ... | <unusedn>] llama (SentencePiece)

For the real vocab sizes the special blocks sit at their real ids (151643,
199998, 151329); for tiny vocabularies they follow the BPE directly. Gemma's low
special ids are real in every size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).parent.parent / "data"
CORPUS = DATA_DIR / "corpus.txt"

# gguf TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's "qwen2" pre-split (single digits), contraction group expanded.
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "gpt-4o" pre-split (o200k, 1-3 digit groups).
O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp forces this split for gemma4: lines and newline runs; spaces become "▁".
GEMMA4_REGEX = r"[^\n]+|[\n]+"
SPACE = "\u2581"  # ▁

# Qwen2.5/Qwen3 added tokens from id 151643, in order. The <|...|> ones are
# control tokens; the tag-like ones are "special: false" in HF and so
# USER_DEFINED in real GGUFs (their text shows in output, e.g. <think>).
_QWEN_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN_REAL = {"vocab": 151936, "first_special": 151643}

# GLM-4.5's added tokens from id 151329, in order (its tokenizer_config.json).
# The <|...|>, [xMASK], <sop>, <eop> ones are control tokens; the tag-like ones
# are plain added tokens (their text shows in output: <think>, <tool_call>, ...).
_GLM4_ADDED = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|begin_of_transcription|>",
    "<|end_of_transcription|>",
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
    "<|begin_of_box|>",
    "<|end_of_box|>",
    "<|image|>",
    "<|video|>",
]
GLM4_REAL = {"vocab": 151552, "first_special": 151329}
# llama.cpp's "glm4" pre-split: llama3's (1-3 digit groups), contraction group expanded.
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k_harmony ids 199998..200018; None = <|reserved_n|> (control).
_HARMONY = [
    "<|startoftext|>",
    "<|endoftext|>",
    None,
    None,
    "<|return|>",
    "<|constrain|>",
    None,
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    None,
    None,
    None,
    "<|call|>",
    None,
    None,
    None,
    None,
    None,
    "<|endofprompt|>",
]
HARMONY_REAL = {"vocab": 201088, "first_special": 199998}

# Gemma 4 low ids that are known from the real tokenizer; the rest of 0..104
# are placeholders. 107 is the plain newline piece.
_GEMMA_SPECIAL = {
    0: ("<pad>", CONTROL),
    1: ("<eos>", CONTROL),
    2: ("<bos>", CONTROL),
    3: ("<unk>", UNKNOWN),
    4: ("<mask>", USER_DEFINED),
    46: ("<|tool>", CONTROL),
    47: ("<tool|>", CONTROL),
    48: ("<|tool_call>", CONTROL),
    49: ("<tool_call|>", CONTROL),
    50: ("<|tool_response>", CONTROL),
    51: ("<tool_response|>", CONTROL),
    52: ('<|"|>', CONTROL),
    98: ("<|think|>", CONTROL),
    100: ("<|channel>", CONTROL),
    101: ("<channel|>", CONTROL),
    105: ("<|turn>", CONTROL),
    106: ("<turn|>", CONTROL),
    107: ("\n", NORMAL),
}
_GEMMA_N_LOW = 108


@dataclass(frozen=True)
class Vocab:
    """Everything `tokenizer.ggml.*` needs, ids are list indices."""

    model: str  # "gpt2" | "gemma4"
    pre: str  # tokenizer.ggml.pre
    regex: str  # the pre-split that `pre` names (for tests and loaders)
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]  # "A B"
    bos: int
    eos: int
    pad: int
    unk: int | None
    add_bos: bool
    eot: int | None = None  # tokenizer.ggml.eot_token_id / eom_token_id (glm4moe), also end-of-generation
    eom: int | None = None
    scores: tuple[float, ...] = ()  # tokenizer.ggml.scores (llama SPM: the merge priority of each piece)
    add_eos: bool | None = None  # tokenizer.ggml.add_eos_token, where the family's converter writes it

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def corpus_lines() -> list[str]:
    return CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)


# --- byte-level BPE (qwen3moe, gpt-oss) ---------------------------------------


@lru_cache(maxsize=8)
def train_byte_level(regex: str, n_bpe: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens by id, merges) of a GPT-2 byte-level BPE trained on the corpus.

    Pre-split with `regex` then the GPT-2 byte map, like llama.cpp's gpt2 path.
    The trainer is deterministic (ties broken by pair order), so the same
    arguments give the same vocab in every process.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    return _tokens_and_merges(tok)


def _tokens_and_merges(tok) -> tuple[tuple[str, ...], tuple[str, ...]]:
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = tuple(m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"])
    return tokens, merges


def _fill(size: int, bpe: tuple[str, ...], block: list[tuple[str, int]], block_at: int, placeholder) -> tuple[list[str], list[int]]:
    """BPE tokens, placeholders up to `block_at`, the special block, placeholders up to `size`."""
    tokens = list(bpe)
    types = [NORMAL] * len(bpe)
    for i in range(len(tokens), block_at):
        tokens.append(placeholder(i))
        types.append(UNUSED)
    for text, typ in block:
        tokens.append(text)
        types.append(typ)
    for i in range(len(tokens), size):
        tokens.append(placeholder(i))
        types.append(UNUSED)
    return tokens, types


def _check_fits(label: str, size: int, n_bpe: int, n_block: int) -> None:
    if n_bpe + n_block > size:
        raise ValueError(f"{label}: vocab size {size} cannot hold {n_bpe} BPE tokens + {n_block} special tokens")


def qwen_vocab(size: int, n_bpe: int, pre: str = "qwen2", regex: str = QWEN2_REGEX) -> Vocab:
    """Qwen's byte-level BPE and added tokens, on the split `pre` names (`regex`)."""
    bpe, merges = train_byte_level(regex, n_bpe)
    block = [(t, CONTROL if t.startswith("<|") else USER_DEFINED) for t in _QWEN_ADDED]
    _check_fits("qwen3moe", size, len(bpe), len(block))
    at = QWEN_REAL["first_special"] if size == QWEN_REAL["vocab"] else len(bpe)
    tokens, types = _fill(size, bpe, block, at, lambda i: f"[PAD{i}]")
    return Vocab(
        model="gpt2",
        pre=pre,
        regex=regex,
        tokens=tuple(tokens),
        types=tuple(types),
        merges=merges,
        bos=at,
        eos=at + 2,
        pad=at,
        unk=None,
        add_bos=False,  # eos <|im_end|>, bos/pad <|endoftext|>
    )


def harmony_vocab(size: int, n_bpe: int) -> Vocab:
    bpe, merges = train_byte_level(O200K_REGEX, n_bpe)
    at = HARMONY_REAL["first_special"] if size == HARMONY_REAL["vocab"] else len(bpe)
    block = [(t or f"<|reserved_{at + k}|>", CONTROL) for k, t in enumerate(_HARMONY)]
    _check_fits("gpt-oss", size, len(bpe), len(block))
    tokens, types = _fill(size, bpe, block, at, lambda i: f"<|reserved_{i}|>")
    return Vocab(
        model="gpt2",
        pre="gpt-4o",
        regex=O200K_REGEX,
        tokens=tuple(tokens),
        types=tuple(types),
        merges=merges,
        bos=at,
        eos=at + 4,
        pad=at + 19,
        unk=None,
        add_bos=False,  # <|startoftext|>, <|return|>, 200017
    )


def glm4_vocab(size: int, n_bpe: int) -> Vocab:
    bpe, merges = train_byte_level(LLAMA3_REGEX, n_bpe)
    block = [(t, CONTROL if t.startswith(("<|", "[", "<sop", "<eop")) else USER_DEFINED) for t in _GLM4_ADDED]
    _check_fits("glm4moe", size, len(bpe), len(block))
    at = GLM4_REAL["first_special"] if size == GLM4_REAL["vocab"] else len(bpe)
    tokens, types = _fill(size, bpe, block, at, lambda i: f"[PAD{i}]")
    return Vocab(
        model="gpt2",
        pre="glm4",
        regex=LLAMA3_REGEX,
        tokens=tuple(tokens),
        types=tuple(types),
        merges=merges,
        bos=at + 2,  # [gMASK], as llama.cpp's converter sets it (its "glm4" loader then adds no BOS)
        eos=at,  # <|endoftext|>
        pad=at,
        unk=at,
        add_bos=False,
        eot=at + 7,  # <|user|>: the model's turn is over
        eom=at + 9,  # <|observation|>: a tool call waits for its result
    )


# --- SPM-style BPE (gemma4) ---------------------------------------------------


@lru_cache(maxsize=4)
def train_spm_style(n_bpe: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(pieces by id, merges) of a BPE over unicode chars with "▁" for spaces.

    Training splits lines into words at "▁" (a word starts with its space)
    so no merge crosses a word boundary; at run time gemma4 only splits on
    newlines, which then gives the same pieces.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"), pre_tokenizers.Split(SPACE, behavior="merged_with_next")]
    )
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=1, show_progress=False, initial_alphabet=[SPACE, "\n"])
    tok.train_from_iterator(corpus_lines(), trainer)
    return _tokens_and_merges(tok)


def gemma_vocab(size: int, n_bpe: int) -> Vocab:
    pieces, merges = train_spm_style(n_bpe)
    tokens: list[str] = []
    types: list[int] = []
    for i in range(_GEMMA_N_LOW):
        text, typ = _GEMMA_SPECIAL.get(i, (f"<unused{i}>", UNUSED))
        tokens.append(text)
        types.append(typ)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            tokens.append(p)
            types.append(NORMAL)
    if len(tokens) > size:
        raise ValueError(f"gemma4: vocab size {size} cannot hold {len(tokens)} tokens")
    for i in range(len(tokens), size):
        tokens.append(f"<unused{i}>")
        types.append(UNUSED)
    return Vocab(
        model="gemma4",
        pre="gemma4",
        regex=GEMMA4_REGEX,
        tokens=tuple(tokens),
        types=tuple(types),
        merges=merges,
        # llama.cpp's Gemma4Model writes a score per token (gguf-py LlamaHfVocab's -1000.0 for every
        # token of a BPE tokenizer.json); its gemma4 tokenizer merges by the merges, not these
        scores=(-1000.0,) * len(tokens),
        bos=2,
        eos=1,
        pad=0,
        unk=3,
        add_bos=True,
    )


# --- SentencePiece (llama: Mixtral) -------------------------------------------

_LLAMA_LOW = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]


def llama_vocab(size: int, n_bpe: int) -> Vocab:
    """Llama/Mistral's layout: <unk> <s> </s>, the 256 byte pieces, then the pieces,
    each scored by when training made it (earlier = higher), as SentencePiece's
    BPE scores are; run by llama.cpp's SPM merge (`spm_merges`)."""
    pieces, _ = train_spm_style(n_bpe)
    tokens = [t for t, _ in _LLAMA_LOW] + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in _LLAMA_LOW] + [BYTE] * 256
    seen = set(tokens)
    tokens += [p for p in pieces if p not in seen]
    types += [NORMAL] * (len(tokens) - len(types))
    if len(tokens) > size:
        raise ValueError(f"llama: vocab size {size} cannot hold {len(tokens)} tokens")
    scores = [0.0] * len(_LLAMA_LOW) + [0.0] * 256 + [-float(k) for k in range(len(tokens) - len(_LLAMA_LOW) - 256)]
    for i in range(len(tokens), size):
        tokens.append(f"<unused{i}>")
        types.append(UNUSED)
        scores.append(0.0)
    return Vocab(
        model="llama",
        pre="default",
        regex="",
        tokens=tuple(tokens),
        types=tuple(types),
        merges=(),
        bos=1,
        eos=2,
        pad=0,
        unk=0,
        add_bos=True,
        scores=tuple(scores),
    )


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """llama.cpp's SentencePiece merge as BPE merges: SPM repeatedly joins the
    adjacent pair whose concatenation is a piece with the highest score (ties:
    leftmost); a BPE whose merges are every split (a, b) of every piece, ranked
    by that piece's score, does the same. Byte and unused pieces are never made
    by a merge. The splits of one piece keep their left part's length order."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] in (BYTE, UNUSED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in ids and b in ids:
                found.append((-scores[i], i, cut, a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


def hf_tokenizer(vocab: Vocab):
    """A `tokenizers.Tokenizer` that runs `vocab` the way llama.cpp does.

    Test oracle and reference for our own loader: pre-split with the regex
    `pre` names, BPE with the stored merges, specials (types 3/4) matched
    before BPE.
    """
    return tokenizer_from_gguf_fields(vocab.model, vocab.regex, list(vocab.tokens), list(vocab.types), list(vocab.merges))


def tokenizer_from_gguf_fields(model: str, regex: str, tokens: list[str], types: list[int], merges: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ids = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:  # split at the first space at index >= 1 (llama.cpp's rule)
        i = m.index(" ", 1)
        pairs.append((m[:i], m[i + 1 :]))
    if model == "gpt2":
        tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
    elif model == "gemma4":
        tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        raise ValueError(f"tokenizer model {model!r} is not supported")
    specials = [
        AddedToken(t, special=(ty == CONTROL), normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, USER_DEFINED) and t != "\n"
    ]
    tok.add_special_tokens([s for s in specials if s.special])
    tok.add_tokens([s for s in specials if not s.special])
    return tok
