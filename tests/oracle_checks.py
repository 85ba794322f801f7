"""The oracle harness's checks: a family's checkpoints and made models against
transformers and llama.cpp, each held to its `FamilyOracle` (tests/oracle.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from .oracle import LLAMA_CPP_REASON, N_CTX, N_GREEDY, N_GREEDY_LLAMA_CPP, N_GREEDY_Q8_0, Checkpoint, FamilyOracle

# The text checks against transformers' own tokenizer and chat template.
MULTILINGUAL = (
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln: Äpfel, Öl und Übermut — 100 % ß.",
    "我们今天去公园散步，天气很好。",
    "Emoji: 🙂🚀 and café, naïve, São Paulo.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Numbers: 3.14159, 2024-11-30, 1234567890",
    "   leading spaces\tand tabs\r\nwindows newline",
)
CONVERSATIONS = (
    [{"role": "user", "content": "Hello! How are you?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
)


# -- shared pieces --------------------------------------------------------------


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def ours_greedy(model, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(ids) + n + 1)
    logits, out = model.prefill(ids, cache), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.decode_one(out[-1], cache)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llama(path: Path, n_ctx: int = N_CTX, reason: str = LLAMA_CPP_REASON, **kw):
    """llama.cpp on `path` with every position's logits, an F32 KV cache and no flash attention."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=reason)
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0, flash_attn=False, **kw)


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


# -- the checks against transformers ---------------------------------------------


def check_f32_logits_and_greedy(ck: Checkpoint) -> None:
    """Every position's f32 logits on every prompt, and the default tier's greedy tokens."""
    n, k = ck.oracle.greedy_default
    with open_model(ck.gguf()) as mf:
        model = load_model(mf)
        for ids in ck.prompts:
            rel = rel_err(model.forward(ids, model.new_cache(N_CTX), all_logits=True), ck.hf_logits(ids))
            assert rel < ck.oracle.f32_rel, f"{ck.name}: logits differ by {rel:.2e} relative (prompt {ids[:5]}...)"
        for ids in ck.prompts[:k]:
            assert ours_greedy(model, ids, n) == ck.hf_greedy(ids, n), f"{ck.name}: greedy tokens differ"


def check_greedy_rest(ck: Checkpoint) -> None:
    """N_GREEDY greedy tokens on the prompts the default tier left out."""
    n, k = ck.oracle.greedy_default
    with open_model(ck.gguf()) as mf:
        model = load_model(mf)
        for i, ids in enumerate(ck.prompts):
            if i < k and n >= N_GREEDY:
                continue
            assert ours_greedy(model, ids, N_GREEDY) == ck.hf_greedy(ids, N_GREEDY), f"{ck.name}: greedy tokens differ"


def check_q8_0(ck: Checkpoint) -> str:
    """The q8_0 conversion within the family's `Q8Bound`; returns the errors found."""
    bound, path = ck.oracle.q8_0, ck.gguf("q8_0")
    if bound.rel is None:
        pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    errs, wants, prefixes = [], [], []
    with open_model(path) as mf:
        model = load_model(mf)
        for ids in ck.prompts:
            want = ck.hf_logits(ids)[-1]
            got = model.forward(ids, model.new_cache(N_CTX))[-1]
            errs.append(rel_err(got, want))
            wants.append(want)
            if bound.argmax:
                assert int(np.argmax(got)) == int(np.argmax(want)), f"{ck.name}: q8_0 top token differs (prompt {ids[:5]}...)"
            if bound.greedy_prefix:
                prefixes.append(common_prefix(ours_greedy(model, ids, N_GREEDY_Q8_0), ck.hf_greedy(ids, N_GREEDY_Q8_0)))
    report = f"{ck.name} q8_0: relative logit error {np.round(errs, 3)}"
    if bound.greedy_prefix:
        report += f"; greedy tokens agreeing before the first difference (of {N_GREEDY_Q8_0}): {prefixes}"
        assert sum(p >= 3 for p in prefixes) >= 2, (ck.name, prefixes)
    if bound.rel is not None and max(errs) < bound.rel:
        return report
    assert bound.llama_cpp is not None, report  # past the fixed bound, with nothing else to hold it to
    beyond = [i for i, e in enumerate(errs) if bound.rel is None or e >= bound.rel]
    reason = f"{ck.name}: q8_0 off by {max(errs):.2f}; llama.cpp would say if it is too"
    theirs = llama_cpp_errors(path, [ck.prompts[i] for i in beyond], [wants[i] for i in beyond], reason)
    report += f", llama.cpp's {np.round(theirs, 3)}"
    factor, slack = bound.llama_cpp
    if bound.rel is None:  # the worst prompt of each
        assert max(errs) <= factor * max(theirs) + slack, report
    else:  # prompt by prompt
        for i, their in zip(beyond, theirs):
            assert errs[i] <= factor * their + slack, f"{ck.name}: q8_0 off by {errs[i]:.3f}, llama.cpp's by {their:.3f}"
    return report


def llama_cpp_errors(path: Path, prompts: list[list[int]], wants: list[np.ndarray], reason: str) -> list[float]:
    """llama.cpp's relative error on `path` against each prompt's last-position logits `wants`."""
    llm = llama(path, reason=reason)
    try:
        errs = []
        for ids, want in zip(prompts, wants):
            llm.reset()
            llm.eval(ids)
            errs.append(rel_err(np.asarray(llm.scores[len(ids) - 1]), want))
        return errs
    finally:
        llm.close()


def check_tokenizer_matches_transformers(ck: Checkpoint) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ck.hf_dir)
    with open_model(ck.gguf()) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
    for text in MULTILINGUAL:
        want = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_bos=False) == want, f"{ck.name}: {text!r}"
        assert tok.decode(want) == hf.decode(want), f"{ck.name}: {text!r}"


def check_chat_template_matches_transformers(ck: Checkpoint) -> None:
    from transformers import AutoTokenizer

    from moe_pipe.shared.text.chat import render_chat

    hf = AutoTokenizer.from_pretrained(ck.hf_dir)
    with open_model(ck.gguf()) as mf:
        for messages in CONVERSATIONS:
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert render_chat(mf.gguf, messages, add_generation_prompt=True) == want, ck.name


# -- the checks against llama.cpp -------------------------------------------------


def check_llama_cpp_greedy(ck: Checkpoint) -> None:
    """The converted f32 file through llama.cpp: the GGUF conventions, not just the math."""
    if ck.config.no_llama_cpp:
        pytest.skip(ck.config.no_llama_cpp)
    llm = llama(ck.gguf())
    try:
        with open_model(ck.gguf()) as mf:
            model = load_model(mf)
            for ids in ck.prompts:
                theirs = llama_greedy(llm, ids, N_GREEDY_LLAMA_CPP)
                assert ours_greedy(model, ids, N_GREEDY_LLAMA_CPP) == theirs, f"{ck.name}: greedy tokens differ from llama.cpp"
    finally:
        llm.close()


def check_made_f32(path: Path, ids: list[int], tol: float, texts: tuple[str, ...] = ()) -> None:
    """A made F32 file against llama.cpp: logits at every position of `ids` within
    `tol`, the same top tokens, the same sum of tensor bytes, the same greedy tokens,
    and `texts` (the prompt's) tokenized alike."""
    with open_model(path) as mf:
        tensor_bytes = sum(t.nbytes for t in mf.gguf.tensors.values())
        assert tensor_bytes == mf.layout.dense_bytes + mf.layout.row_bytes + mf.layout.total_expert_bytes
        model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
        ours = model.forward(ids, model.new_cache(64), all_logits=True)
        llm = llama(path, 64)
        try:
            assert llm._model.size() == tensor_bytes  # the same tensor table, the same type sizes
            for text in texts:
                assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=tok.add_bos, special=False), text
            llm.eval(ids)
            theirs = np.asarray(llm.scores[: len(ids)])
            assert ours_greedy(model, ids, N_GREEDY_LLAMA_CPP) == llama_greedy(llm, ids, N_GREEDY_LLAMA_CPP), path.name
        finally:
            llm.close()
    err = rel_err(ours, theirs)
    assert err < tol, f"{path.name}: max relative logit error {err:.3g}"
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def check_made_model(oracle: FamilyOracle, tmp_path: Path) -> None:
    """make-model's tiny preset in F32 against llama.cpp (MadeCheck)."""
    pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    path = make_model(oracle.registry.arch, "tiny", tmp_path / "m.gguf", quant="F32")
    check_made_f32(path, oracle.made.prompt.of(path)[0], oracle.made.tol, oracle.made.prompt.texts)


def check_made_model_loads(oracle: FamilyOracle, tmp_path: Path) -> None:
    """make-model's tiny preset in its own quant mix: llama.cpp loads it with our
    vocabulary, width and tensor bytes, and its logits are finite."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=LLAMA_CPP_REASON)
    path = make_model(oracle.registry.arch, "tiny", tmp_path / f"{oracle.family}.gguf")
    with open_model(path) as mf:
        spec, layout = mf.spec, mf.layout
        tensor_bytes = sum(t.nbytes for t in mf.gguf.tensors.values())
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == spec.n_vocab
        assert llm.n_embd() == spec.n_embd
        # llama.cpp's own sum of tensor sizes equals ours: same tensor table, same type sizes.
        assert llm._model.size() == tensor_bytes == layout.dense_bytes + layout.row_bytes + layout.total_expert_bytes
        tokens = llm.tokenize(b"The river ran past 12 old mills.", add_bos=False)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)])
        assert np.isfinite(logits).all() and np.abs(logits).max() > 0
    finally:
        llm.close()
