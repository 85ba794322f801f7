"""Tokenizer data for `moe-pipe convert`: HF tokenizer.json -> `tokenizer.ggml.*`.

Follows the conventions of shared/gguf/vocab.py (and llama.cpp's converter):
ids are list indices; ids the tokenizer does not define, up to the model's
embedding rows, become "[PAD<id>]" UNUSED entries; added tokens are CONTROL
when `special` and USER_DEFINED otherwise; merges are "A B" strings. The
pre-split name comes from the model type's `TokenizerFacts` (its family's convert
part, shared/convert/rules.py), cross-checked against the tokenizer's own Split
regex when it has one (docs/models.md § Tokenizers).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..gguf.vocab import BYTE, CONTROL, NORMAL, O200K_REGEX, QWEN2_REGEX, UNKNOWN, UNUSED, USER_DEFINED
from ..text.tokenizer import QWEN35_REGEX
from .rules import TokenizerFacts, arch_for
from .source import read_json

log = logging.getLogger(__name__)

# The tokenizer.json spelling of the contraction group vs the expanded one llama.cpp uses.
_CONTRACTIONS_CI = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CONTRACTIONS_EXPANDED = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


def as_written(regex: str) -> str:
    """A Split regex as tokenizer.json files spell it (the keys of `TokenizerFacts.known_pre`)."""
    return regex.replace(_CONTRACTIONS_EXPANDED, _CONTRACTIONS_CI)


# Splits llama.cpp names alike for every family (a family's own are its `TokenizerFacts.known_pre`).
_KNOWN_PRE = {
    as_written(QWEN2_REGEX): "qwen2",
    as_written(QWEN35_REGEX): "qwen35",  # Qwen3.5/3.6's tokenizer.json
    O200K_REGEX: "gpt-4o",
}
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
    scores: list[float] | None = None  # SentencePiece: each piece's merge priority
    add_space_prefix: bool | None = None  # a space before the text (SentencePiece's dummy prefix); None: not written


def read_vocab(hf_dir: Path, arch: str, n_vocab: int, config: dict[str, Any]) -> HFVocab:
    """The tokenizer of `hf_dir` as GGUF tokenizer fields for `n_vocab` embedding rows, by the
    `TokenizerFacts` of `config`'s model_type; `arch` (the GGUF arch) names it in messages."""
    facts = arch_for(config).tokenizer
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{hf_dir}: tokenizer.json is missing (convert needs the fast-tokenizer file)")
    tj = read_json(path)
    tc_path = hf_dir / "tokenizer_config.json"
    tc = read_json(tc_path) if tc_path.is_file() else {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: tokenizer model is {model.get('type')!r}; convert supports BPE tokenizers only")
    if facts.byte_level is not None and _is_byte_level(tj):
        facts = facts.byte_level  # e.g. a Llama-3-style tokenizer on a llama-arch checkpoint

    if facts.model == "gpt2" and "ByteLevel" not in json.dumps(tj.get("pre_tokenizer")):
        raise UserError(f"{path}: {arch} needs a byte-level BPE tokenizer (no ByteLevel pre-tokenizer found)")
    if facts.sentencepiece and not model.get("byte_fallback"):
        raise UserError(
            f"{path}: {arch} needs a SentencePiece-style BPE tokenizer (byte_fallback with <0xXX> pieces) or a byte-level one; this one is neither"
        )
    pre = _check_pre(path, tj, arch, facts)

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
        if text in facts.visible:
            types.append(USER_DEFINED)
        elif i in added:
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif text == unk_text:
            types.append(UNKNOWN)
        elif facts.byte_pieces and _BYTE_PIECE.fullmatch(text):
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
        add_bos = _post_processor_adds_bos(tj) or facts.add_bos
    add_eos = tc.get("add_eos_token")
    fixed = {k: ids.get(t) for k, t in facts.specials.items()}
    return HFVocab(
        model=facts.model,
        pre=pre,
        tokens=tokens,
        types=types,
        merges=[] if facts.sentencepiece else merges,  # llama.cpp's SPM files have scores instead
        bos=fixed.get("bos") if fixed.get("bos") is not None else special("bos_token"),
        eos=special("eos_token"),
        pad=special("pad_token"),
        unk=ids.get(unk_text) if unk_text else special("unk_token"),
        add_bos=bool(add_bos),
        add_eos=None if add_eos is None else bool(add_eos),
        chat_template=_chat_template(hf_dir, tc),
        eot=fixed.get("eot"),
        eom=fixed.get("eom"),
        **(_sentencepiece(tj, tokens, merges) if facts.sentencepiece else {"add_space_prefix": facts.space_prefix}),
    )


def _is_byte_level(tj: dict) -> bool:
    """A byte-level BPE tokenizer.json: a ByteLevel pre-tokenizer and no byte fallback."""
    return "ByteLevel" in json.dumps(tj.get("pre_tokenizer")) and not (tj.get("model") or {}).get("byte_fallback")


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


def _check_pre(path: Path, tj: dict, arch: str, facts: TokenizerFacts) -> str:
    if facts.pre_fixed:
        return facts.pre
    regexes = _split_regexes(tj.get("pre_tokenizer"))
    if not regexes:
        return facts.pre
    ci = as_written(regexes[0])
    known = facts.known_pre.get(ci) or _KNOWN_PRE.get(ci)
    if known is None:
        # A pre-split llama.cpp does not know: keep the arch's, but say so.
        log.warning("%s: unrecognised pre-tokenizer regex; writing tokenizer.ggml.pre=%r (the %s default)", path, facts.pre, arch)
        return facts.pre
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
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.add_space_prefix is not None:  # after the scores, as llama.cpp's SPM files have it
        w.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        w.add_chat_template(v.chat_template)
