"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata.

The goal is llama.cpp's token ids for the same file (docs/models.md § Tokenizers),
built with HF `tokenizers` so encoding runs in Rust:

    gpt2   (byte-level BPE)  Split(regex of `tokenizer.ggml.pre`, isolated)…
                             → ByteLevel(no regex) → BPE(merges)
    gemma4 (SPM-style BPE)   " " → "▁", split into lines and newline runs,
                             BPE(merges, byte_fallback to <0xXX>)

Special tokens are matched before BPE, as llama.cpp's
`tokenizer_st_partition` does:

    token_type 3 CONTROL, 2 UNKNOWN   matched only with special=True; with
                                      special=False their text is plain text
    token_type 4 USER_DEFINED         always matched (Qwen's <think>,
                                      <tool_call>): they are ordinary pieces
                                      of the vocabulary, and llama.cpp and HF
                                      both match them whatever `special` says
    token_type 5 UNUSED, 6 BYTE       never matched as text

Two things llama.cpp does that the HF pipeline alone would not, and that we
copy on purpose:

* gemma4: a run of newlines that is itself a vocabulary entry is one token
  even when no merge chain reaches it (llama.cpp PR 21343). We split the
  newline runs off in Python and look them up before handing lines to HF.
* gpt-oss: `<|end|>` is *not* end-of-generation when `<|return|>` and
  `<|call|>` exist (the analysis channel ends with `<|end|>` and the final
  answer follows it). See `eog_ids`.

One thing llama.cpp does that we do not copy: for gpt-oss it re-types
`<|start|>`, `<|channel|>`, `<|message|>`, `<|constrain|>` and `<|end|>` as
user-defined so that they render in its output; it then also matches them in
text tokenized with special=False. Here they stay control tokens, so user
text can never inject a harmony frame.

Decoding is byte-exact and pure Python: every id maps to its bytes
(`token_bytes`), text is the UTF-8 decoding of the concatenation. The same
table drives `StreamDecoder`, so streaming and whole-text decoding agree.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import GGUFError, UserError
from ..gguf.vocab import BYTE, CONTROL, LLAMA3_REGEX, NORMAL, QWEN2_REGEX, UNKNOWN, USER_DEFINED

SPACE = "\u2581"  # ▁, SentencePiece's visible space

# --- pre-split regexes ---------------------------------------------------------
# The forms llama.cpp runs (case-insensitive contraction groups spelled out:
# `(?i:'s)` would also match "'ſ", llama.cpp's does not).
# qwen2's and llama3's are shared/gguf/vocab.py's (made files are trained on them).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's "qwen35" (Qwen3.5/3.6): qwen2's split with combining marks (\p{M}) kept inside words.
QWEN35_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_O200K_SUFFIX = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _O200K_SUFFIX
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _O200K_SUFFIX
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
GEMMA4_REGEX = r"[^\n]+|[\n]+"
# llama.cpp's BAILINGMOE2 (Ling 2.0 and 3.0): Qwen2's, but one newline per \s*[\r\n] piece
BAILINGMOE2_REGEX = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreSplit:
    """How a `tokenizer.ggml.pre` name splits text before BPE.

    `regexes` run one after another, each splitting every piece the previous
    one left (matches and the gaps between them both stay pieces).
    `ignore_merges`: a piece that is a whole vocabulary entry is one token.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token


_QWEN2 = PreSplit((QWEN2_REGEX,))
_O200K = PreSplit((O200K_REGEX,))
_LLAMA3 = PreSplit((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_GPT2 = PreSplit((GPT2_REGEX,))
# llama.cpp's fallback for a missing or "default" pre; its own log calls the
# result degraded, but it is what the file gets there, so we match it.
_DEFAULT = PreSplit(
    (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)", r"\p{N}+", r"[0-9][0-9][0-9]")
)
# llama.cpp's DEEPSEEK_LLM ("deepseek-llm": DeepSeek-V2, V2-Lite, V2.5): newlines alone, then
# runs of cased letters (Latin, Greek, Cyrillic, ... as explicit ranges) with one optional
# leading space, runs of ASCII and full-width punctuation, trailing spaces, CJK and Hangul
# runs, digit runs. Code points spelled \uXXXX: the same ranges as llama.cpp's literals.
DEEPSEEK_LLM_REGEXES = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
# llama.cpp's DEEPSEEK3_LLM ("deepseek-v3": DeepSeek-V3, R1, V3.1): 1-3 digit groups, CJK and
# kana runs, then words (an ASCII punctuation mark may lead a Latin word), punctuation runs, spaces.
DEEPSEEK_V3_REGEXES = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)

PRE_SPLITS: dict[str, PreSplit] = {
    "qwen2": _QWEN2,
    "qwen35": PreSplit((QWEN35_REGEX,)),
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "gpt-4o": _O200K,
    "llama4": _O200K,
    "glm4": PreSplit((LLAMA3_REGEX,)),  # llama.cpp's CHATGLM4: llama3's split, merges as usual, no BOS
    "chatglm-bpe": PreSplit((LLAMA3_REGEX,)),
    "lfm2": PreSplit((LLAMA3_REGEX,)),  # llama.cpp's LFM2: llama3's split, merges as usual
    "bailingmoe2": PreSplit((BAILINGMOE2_REGEX,)),
    "deepseek-llm": PreSplit(DEEPSEEK_LLM_REGEXES),
    "deepseek-v3": PreSplit(DEEPSEEK_V3_REGEXES),
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "gpt-2": _GPT2,
    "olmo": _GPT2,
    "mpt": _GPT2,
    "phi-2": _GPT2,
    "default": _DEFAULT,
    "": _DEFAULT,
}

# End-of-generation by token text, the subset of llama.cpp's list that our
# architectures (and their MoE relatives) use; plus eos and the eot/eom keys.
_EOG_TEXTS = frozenset(
    {
        "<|im_end|>",
        "<|endoftext|>",
        "<|end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|return|>",
        "<|call|>",  # o200k_harmony
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<end_of_turn>",  # gemma
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",  # Qwen FIM: llama.cpp stops on these too
    }
)

_NEWLINE_RUNS = re.compile(r"(\n+)")


def _gpt2_byte_map() -> dict[int, str]:
    """GPT-2's reversible byte → printable char map.

    Bytes that are printable Latin-1 map to themselves; the other 68 take the
    code points from 256 up, in byte order.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_CHAR_TO_BYTE = {c: b for b, c in _gpt2_byte_map().items()}


class Tokenizer:
    """Encode/decode exactly like llama.cpp does for the same GGUF file.

    Build with `Tokenizer.from_gguf(f)`. `hf` is the underlying
    `tokenizers.Tokenizer` (special tokens matched); it is complete on its
    own except for the gemma4 newline-run rule above.
    """

    def __init__(
        self,
        *,
        model: str,
        pre: str,
        tokens: list[str],
        types: list[int],
        merges: list[str],
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        eot_id: int | None = None,
        eom_id: int | None = None,
        chat_template: str | None = None,
        source: str = "<tokens>",
        scores: list[float] | None = None,
        add_space_prefix: bool = True,
    ):
        self.model = model
        self.pre = pre
        self.source = source
        self.n_vocab = len(tokens)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._tokens = tokens
        self._types = types
        self._bytes: list[bytes | None] = [None] * len(tokens)  # filled lazily: building it eagerly costs ~0.3 s at 262k
        control = [i for i, t in enumerate(types) if t == CONTROL or t == UNKNOWN]
        user = [i for i, t in enumerate(types) if t == USER_DEFINED]
        self._special = frozenset(control)
        self.eog_ids = _eog_ids(tokens, eos_id, eot_id, eom_id)
        if model == "llama":  # SentencePiece: merges from the scores (shared/gguf/vocab.py spm_merges)
            from ..gguf.vocab import spm_merges

            merges = [f"{a} {b}" for a, b in spm_merges(tokens, list(scores or [0.0] * len(tokens)), types)]
        self.hf, self._hf_plain = _build_hf(model, pre, tokens, control, user, merges, source, add_space_prefix)
        # gemma4: newline runs that are vocabulary entries are one token (see
        # module doc). Splitting them off before HF is only equivalent while
        # no matched token contains "\n".
        self._split_newlines = model == "gemma4" and not any("\n" in tokens[i] for i in control + user)

    # -- building ---------------------------------------------------------
    @classmethod
    def from_gguf(cls, f) -> Tokenizer:
        """The tokenizer of an opened `GGUFFile`; a `GGUFError` if it has none we can run."""
        model = f.meta("tokenizer.ggml.model")
        if model is None or not f.has("tokenizer.ggml.tokens"):
            raise GGUFError(
                f.path, "has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing); moe-pipe needs a GGUF with its vocabulary"
            )
        tokens = list(f.meta("tokenizer.ggml.tokens"))
        types = f.meta("tokenizer.ggml.token_type")
        types = [NORMAL] * len(tokens) if types is None else list(types)
        if len(types) < len(tokens):
            raise GGUFError(f.path, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        types = types[: len(tokens)]
        pre = f.meta("tokenizer.ggml.pre", "") or ""
        if model == "gemma4":
            pre = "gemma4"  # llama.cpp forces it, whatever the file says
        add_bos = f.meta("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = model == "llama" or (PRE_SPLITS[pre].add_bos if pre in PRE_SPLITS else False)  # llama.cpp: SPM adds BOS by default
        if model == "gemma4":
            add_bos = True  # llama.cpp overrides a false flag for gemma4 (PR 21500)

        def special_id(key: str) -> int | None:
            v = f.meta(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            types=types,
            merges=list(f.meta("tokenizer.ggml.merges", []) or []),
            bos_id=special_id("bos_token_id"),
            eos_id=special_id("eos_token_id"),
            pad_id=special_id("padding_token_id"),
            eot_id=special_id("eot_token_id"),
            eom_id=special_id("eom_token_id"),
            add_bos=bool(add_bos),
            chat_template=f.meta("tokenizer.chat_template"),
            source=str(f.path),
            scores=list(f.meta("tokenizer.ggml.scores", []) or []) if model == "llama" else None,
            add_space_prefix=bool(f.meta("tokenizer.ggml.add_space_prefix", True)),
        )

    # -- encoding ---------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_bos: None = the GGUF's add_bos_token flag. A rendered chat prompt
        that already starts with the BOS text (gemma4's template writes
        `<bos>`) must be encoded with add_bos=False, or it gets two.
        special: match control tokens (`<|im_end|>`) in the text; False for
        untrusted text that must not become control tokens.
        """
        hf = self.hf if special else self._hf_plain
        if self._split_newlines:
            ids = self._encode_by_lines(hf, text)
        else:
            ids = hf.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos:
            if self.bos_id is None:
                raise UserError(f"{self.source}: add_bos was asked for but the model has no tokenizer.ggml.bos_token_id")
            ids.insert(0, self.bos_id)
        return ids

    def _encode_by_lines(self, hf, text: str) -> list[int]:
        parts = _NEWLINE_RUNS.split(text)  # odd indices are newline runs
        whole = {k: self.hf.token_to_id(p) for k, p in enumerate(parts) if k % 2}
        todo = [k for k, p in enumerate(parts) if p and whole.get(k) is None]
        encoded = dict(zip(todo, hf.encode_batch([parts[k] for k in todo], add_special_tokens=False)))
        ids: list[int] = []
        for k, p in enumerate(parts):
            if k in encoded:
                ids += encoded[k].ids
            elif p:
                ids.append(whole[k])
        return ids

    # -- decoding ---------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. "Ġthe", "▁the", "<0x0A>")."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        return self._types[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """Control (or unknown) token: dropped by decode(skip_special=True)."""
        return token_id in self._special

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in output text (may be part of a UTF-8 character)."""
        b = self._bytes[self._check_id(token_id)]
        if b is None:
            b = self._bytes[token_id] = self._piece_bytes(token_id)
        return b

    def _piece_bytes(self, i: int) -> bytes:
        text, typ = self._tokens[i], self._types[i]
        if typ in (CONTROL, USER_DEFINED, UNKNOWN):
            return text.encode("utf-8")  # matched as raw text, so they render as it
        if self.model in ("gemma4", "llama"):
            if typ == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            return text.replace(SPACE, " ").encode("utf-8")
        # byte-level: every char is one byte; a char outside the map (never in
        # a converted vocab) is kept as its UTF-8 rather than dropped
        return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8") for c in text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a cut-off character) becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids if not (skip_special and i in self._special)).decode("utf-8", "replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer({self.model}/{self.pre or 'default'}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class StreamDecoder:
    """Feed ids one at a time, get back only the newly completed text.

    A UTF-8 character split over several tokens (byte-level BPE, <0xXX>
    fallback) is held back until its last byte arrives, so the pieces joined
    equal `decode` of all ids. Call `flush()` at the end: it returns what is
    left (an unfinished character as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def feed_many(self, ids: Sequence[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --- helpers -------------------------------------------------------------------


def _eog_ids(tokens: list[str], eos: int | None, eot: int | None, eom: int | None) -> frozenset[int]:
    ids = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
    ids |= {i for i in (eos, eot, eom) if i is not None}
    texts = {tokens[i] for i in ids}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts:
        # harmony: <|end|> closes the analysis message, the answer comes after
        ids -= {i for i in ids if tokens[i] == "<|end|>" and i not in (eos, eot, eom)}
    return frozenset(ids)


def _merge_pairs(merges: list[str], source: str) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        i = m.find(" ", 1)  # at index >= 1: a merge may start with a space char
        if i < 0:
            raise GGUFError(source, f"tokenizer.ggml.merges entry {m!r} is not two pieces separated by a space")
        pairs.append((m[:i], m[i + 1 :]))
    return pairs


def _first_bad_merge(pairs: list[tuple[str, str]], vocab: dict[str, int]) -> str | None:
    """Only run after the fast path failed: names the entry, for the error message."""
    for k, (a, b) in enumerate(pairs):
        for piece in (a, b, a + b):
            if piece not in vocab:
                return f"merge {k} ({a!r} {b!r}) needs {piece!r}, which is not a token"
    return None


def _build_hf(
    model: str, pre: str, tokens: list[str], control: list[int], user: list[int], merges: list[str], source: str, space_prefix: bool = True
):
    """(tokenizer with specials matched, the same with control tokens as plain text).

    Both share one BPE model object, so the second costs only its added-token
    table.
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    split: PreSplit | None = None  # set exactly when model == "gpt2"
    if model == "gpt2":
        split = PRE_SPLITS.get(pre)
        if split is None:
            known = ", ".join(sorted(k for k in PRE_SPLITS if k))
            raise GGUFError(
                source,
                f"tokenizer.ggml.pre {pre!r} is not supported (known: {known}); its pre-split regex would have to be added to moe_pipe.shared.text.tokenizer.PRE_SPLITS",
            )
    elif model not in ("gemma4", "llama"):
        raise GGUFError(
            source,
            f"tokenizer.ggml.model {model!r} is not supported (supported: gpt2 byte-level BPE, gemma4 SPM-style BPE, llama SentencePiece)",
        )

    vocab = dict(zip(tokens, range(len(tokens))))
    if "" in vocab:  # llama.cpp renames empty entries the same way
        for i, t in enumerate(tokens):
            tokens[i] = t or f"[EMPTY_{i}]"
        vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        first: dict[str, int] = {}
        for i, t in enumerate(tokens):
            j = first.setdefault(t, i)
            if j != i:
                raise GGUFError(source, f"duplicate token in vocabulary: {t!r} has ids {j} and {i}")
    pairs = _merge_pairs(merges, source)
    try:
        if split is not None:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=split.ignore_merges)
        else:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=True)
    except BaseException as exc:  # a bad merge is an Exception or a Rust panic (PanicException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise GGUFError(source, f"tokenizer.ggml.merges do not fit the vocabulary: {_first_bad_merge(pairs, vocab) or exc}") from None

    def configured():
        tok = HFTokenizer(bpe)
        if split is not None:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            tok.decoder = decoders.ByteLevel()
        elif model == "llama":
            # llama.cpp: a space before every text fragment that starts the text or follows a
            # special token (added tokens split the text into such fragments here too), then
            # spaces as "▁"; no pre-split: SPM merges over the whole fragment.
            escape = normalizers.Replace(" ", SPACE)
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if space_prefix else escape
            tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            tok.normalizer = normalizers.Replace(" ", SPACE)
            tok.pre_tokenizer = pre_tokenizers.Split(Regex(GEMMA4_REGEX), behavior="isolated")
            tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
        return tok

    with_special, plain = configured(), configured()
    plain.encode_special_tokens = True  # control tokens stay in the table (for decode) but are not split out
    return with_special, plain
