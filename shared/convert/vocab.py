"""Tokenizer data for `moe-pipe convert`: HF tokenizer.json -> `tokenizer.ggml.*`.

Follows the conventions of shared/gguf/vocab.py (and llama.cpp's converter):
ids are list indices; ids the tokenizer does not define, up to the model's
embedding rows, become "[PAD<id>]" UNUSED entries; added tokens are CONTROL
when `special` and USER_DEFINED otherwise; merges are "A B" strings. The
pre-split name comes from the arch, cross-checked against the tokenizer's own
Split regex when it has one (docs/models.md § Tokenizers).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_pipe.shared.convert.source import read_json
from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.vocab import BYTE, CONTROL, LLAMA3_REGEX, NORMAL, O200K_REGEX, QWEN2_REGEX, UNKNOWN, UNUSED, USER_DEFINED
from moe_pipe.shared.text.tokenizer import QWEN35_REGEX

log = logging.getLogger(__name__)

# The tokenizer.json spelling of the contraction group vs the expanded one llama.cpp uses.
_CONTRACTIONS_CI = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CONTRACTIONS_EXPANDED = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_KNOWN_PRE = {
    QWEN2_REGEX.replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI): "qwen2",
    QWEN35_REGEX.replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI): "qwen35",  # Qwen3.5/3.6's tokenizer.json
    O200K_REGEX: "gpt-4o",
}

# gguf arch -> (tokenizer.ggml.model, tokenizer.ggml.pre, add_bos default)
_ARCH_TOKENIZER = {
    "qwen3moe": ("gpt2", "qwen2", False),
    "qwen35moe": ("gpt2", "qwen2", False),
    "gpt-oss": ("gpt2", "gpt-4o", False),
    "gemma4": ("gemma4", "gemma4", True),
    "llama": ("llama", "default", True),  # Mixtral: SentencePiece (scores, no merges in the GGUF)
    "glm4moe": ("gpt2", "glm4", False),
    "lfm2moe": ("gpt2", "lfm2", True),  # LFM2 starts every prompt with <|startoftext|>
    "deepseek2": ("gpt2", "deepseek-llm", True),  # DeepSeek prompts start with <｜begin▁of▁sentence｜>
    "qwen2moe": ("gpt2", "qwen2", False),  # Qwen1.5: the Qwen2 split, no BOS
}
# GLM-4.5's split is llama3's regex, which llama.cpp calls "glm4" for this arch (no BOS, merges as usual).
_ARCH_KNOWN_PRE = {
    "glm4moe": {LLAMA3_REGEX.replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI): "glm4"},
    "lfm2moe": {LLAMA3_REGEX.replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI): "lfm2"},  # LFM2: llama3's split, merges as usual
    # DeepSeek's splits are sequences; within this arch their first regexes tell V2's from V3's
    "deepseek2": {"[\r\n]": "deepseek-llm", r"\p{N}{1,3}": "deepseek-v3"},
}
# llama.cpp's converter sets these for GLM-4.5 (bos, eot, eom); its loader then stops on eot and eom too.
_GLM4_SPECIALS = {"bos": "[gMASK]", "eot": "<|user|>", "eom": "<|observation|>"}

# llama.cpp's gemma4 converter keeps these visible (USER_DEFINED) so chat parsers see them.
_GEMMA4_VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@dataclass(frozen=True)
class HFVocab:
    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: int | None
    eos: int | None
    pad: int | None
    unk: int | None
    add_bos: bool
    add_eos: bool | None
    chat_template: str | None
    eot: int | None = None
    eom: int | None = None
    scores: list[float] | None = None  # llama (SentencePiece): each piece's merge priority
    add_space_prefix: bool = True  # llama: a space before the text, as SentencePiece's dummy prefix


def read_vocab(hf_dir: Path, arch: str, n_vocab: int, config: dict[str, Any]) -> HFVocab:
    """The tokenizer of `hf_dir` as GGUF tokenizer fields for `n_vocab` embedding rows."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{hf_dir}: tokenizer.json is missing (convert needs the fast-tokenizer file)")
    tj = read_json(path)
    tc_path = hf_dir / "tokenizer_config.json"
    tc = read_json(tc_path) if tc_path.is_file() else {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: tokenizer model is {model.get('type')!r}; convert supports BPE tokenizers only")

    gg_model, pre, add_bos_default = _ARCH_TOKENIZER[arch]
    if arch == "deepseek2" and config.get("model_type") == "deepseek_v3":
        pre = "deepseek-v3"  # V3, R1, V3.1 ship V3's split (llama.cpp's name); V2's is deepseek-llm
    if gg_model == "gpt2" and "ByteLevel" not in json.dumps(tj.get("pre_tokenizer")):
        raise UserError(f"{path}: {arch} needs a byte-level BPE tokenizer (no ByteLevel pre-tokenizer found)")
    if gg_model == "llama" and not model.get("byte_fallback"):
        raise UserError(f"{path}: {arch} needs a SentencePiece-style BPE tokenizer (byte_fallback with <0xXX> pieces); this one has none")
    pre = _check_pre(path, tj, arch, pre)

    by_id: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    added: dict[int, dict] = {}
    for a in tj.get("added_tokens", []):
        by_id[int(a["id"])] = a["content"]
        added[int(a["id"])] = a
    if not by_id:
        raise UserError(f"{path}: the vocab is empty")
    top = max(by_id)
    if top >= n_vocab:
        raise UserError(f"{path}: token id {top} ({by_id[top]!r}) does not fit the model's {n_vocab} embedding rows (config vocab_size)")

    unk_text = model.get("unk_token")
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        tokens.append(text)
        if gg_model == "gemma4" and text in _GEMMA4_VISIBLE:
            types.append(USER_DEFINED)
        elif i in added:
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif text == unk_text:
            types.append(UNKNOWN)
        elif gg_model in ("gemma4", "llama") and _BYTE_PIECE.fullmatch(text):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    if unk_text is not None and unk_text in tokens:
        types[tokens.index(unk_text)] = UNKNOWN

    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens) if types[i] != UNUSED}

    def special(key: str) -> int | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            if v not in ids:
                raise UserError(f"{tc_path}: {key} {v!r} is not in the vocab of tokenizer.json")
            return ids[v]
        for cfg in (config, config.get("text_config") or {}):
            cid = cfg.get(f"{key}_id")
            if isinstance(cid, list):
                cid = cid[0] if cid else None
            if isinstance(cid, int) and 0 <= cid < n_vocab:
                return cid
        return None

    add_bos = tc.get("add_bos_token")
    if add_bos is None:
        add_bos = _post_processor_adds_bos(tj) or add_bos_default
    add_eos = tc.get("add_eos_token")
    glm = {k: ids.get(t) for k, t in _GLM4_SPECIALS.items()} if arch == "glm4moe" else {}
    return HFVocab(
        model=gg_model,
        pre=pre,
        tokens=tokens,
        types=types,
        merges=[] if gg_model == "llama" else merges,  # llama.cpp's SPM files have scores instead
        bos=glm.get("bos") if glm.get("bos") is not None else special("bos_token"),
        eos=special("eos_token"),
        pad=special("pad_token"),
        unk=ids.get(unk_text) if unk_text else special("unk_token"),
        add_bos=bool(add_bos),
        add_eos=None if add_eos is None else bool(add_eos),
        chat_template=_chat_template(hf_dir, tc),
        eot=glm.get("eot"),
        eom=glm.get("eom"),
        **(_sentencepiece(tj, tokens, merges) if gg_model == "llama" else {}),
    )


def _sentencepiece(tj: dict, tokens: list[str], merges: list[str]) -> dict[str, Any]:
    """A SentencePiece tokenizer.json (BPE, byte fallback, as transformers converts
    tokenizer.model) as llama.cpp's SPM fields: a score per piece instead of merges.
    transformers lists every split of every piece, ranked by the piece's score, so a
    piece's first merge gives its rank: score = -rank orders the pieces as their
    SentencePiece scores do, and llama.cpp's SPM merge then splits text as the merges
    do (checked against llama.cpp in tests/test_mixtral.py). Pieces no merge makes get
    the lowest score (single characters: 0, never a merge's result)."""
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        cut = m.index(" ", 1)
        rank.setdefault(m[:cut] + m[cut + 1 :], r)
    low = -float(len(merges) + 1)
    scores = [-float(rank[t]) if t in rank else (0.0 if len(t) == 1 else low) for t in tokens]
    # the dummy prefix: legacy files prepend "▁" in the normalizer, newer ones in a Metaspace pre-tokenizer
    pre_tok = tj.get("pre_tokenizer") or {}
    scheme = pre_tok.get("prepend_scheme", "never") if isinstance(pre_tok, dict) and pre_tok.get("type") == "Metaspace" else "never"
    prefix = "Prepend" in json.dumps(tj.get("normalizer")) or scheme in ("first", "always")
    return dict(scores=scores, add_space_prefix=prefix)


def _split_regexes(node: Any) -> list[str]:
    """Every Split-by-Regex pattern in a tokenizer.json pre_tokenizer tree."""
    found: list[str] = []
    if isinstance(node, dict):
        if node.get("type") == "Split" and isinstance(node.get("pattern"), dict) and "Regex" in node["pattern"]:
            found.append(node["pattern"]["Regex"])
        for v in node.values():
            found += _split_regexes(v)
    elif isinstance(node, list):
        for v in node:
            found += _split_regexes(v)
    return found


def _check_pre(path: Path, tj: dict, arch: str, pre: str) -> str:
    if arch == "gemma4":  # llama.cpp forces its own newline split for gemma4
        return pre
    regexes = _split_regexes(tj.get("pre_tokenizer"))
    if not regexes:
        return pre
    ci = regexes[0].replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI)
    known = _ARCH_KNOWN_PRE.get(arch, {}).get(ci) or _KNOWN_PRE.get(ci)
    if known is None:
        # A pre-split llama.cpp does not know: keep the arch's, but say so.
        log.warning("%s: unrecognised pre-tokenizer regex; writing tokenizer.ggml.pre=%r (the %s default)", path, pre, arch)
        return pre
    return known


def _post_processor_adds_bos(tj: dict) -> bool:
    pp = tj.get("post_processor") or {}
    nodes = pp.get("processors", [pp]) if isinstance(pp, dict) else []
    for n in nodes:
        single = n.get("single") if isinstance(n, dict) else None
        if single and "SpecialToken" in single[0]:
            return True
    return False


def _chat_template(hf_dir: Path, tc: dict) -> str | None:
    t = tc.get("chat_template")
    if isinstance(t, list):  # [{name, template}, ...]: llama.cpp keeps the default one
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str) and t:
        return t
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    js = hf_dir / "chat_template.json"
    if js.is_file():
        t = read_json(js).get("chat_template")
        if isinstance(t, str):
            return t
    return None


def add_vocab(w, v: HFVocab) -> None:
    """Write the tokenizer.* keys (same keys as shared/makemodel/maker.py)."""
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    for value, add in ((v.bos, w.add_bos_token_id), (v.eos, w.add_eos_token_id), (v.pad, w.add_pad_token_id), (v.unk, w.add_unk_token_id)):
        if value is not None:
            add(value)
    if v.eot is not None:
        w.add_eot_token_id(v.eot)
    if v.eom is not None:
        w.add_eom_token_id(v.eom)
    w.add_add_bos_token(v.add_bos)
    if v.add_eos is not None:
        w.add_add_eos_token(v.add_eos)
    if v.model == "gemma4":
        w.add_add_space_prefix(False)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.model == "llama":
        w.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        w.add_chat_template(v.chat_template)
