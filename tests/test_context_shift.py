"""Context shift (generate.context_shift, generate.n_keep; docs/conversations.md
§ Context shift): a generation longer than the context keeps going, the
tokens after each shift are those of a fresh run on the kept ids (greedy,
every architecture), n_keep keeps llama.cpp's tokens, and without a shift a
full context ends the reply with finish_reason "length" at the API. On
sliding-window rings too: a kept head whose window rows were overwritten is
recomputed with the tail, and the tokens are still a fresh run's."""

from __future__ import annotations

import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.blocks import KVCache
from moe_pipe.shared.model.load import ModelOptions, load_model
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.serve.openai_api import FINISH_REASONS
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
N_CTX = 64


class Watching(Session):
    """A session that records each shift: the ids it kept and how many tokens
    had been generated then (the last of them is the next one fed)."""

    def __init__(self):
        super().__init__()
        self.generated = 0
        self.shifts: list[tuple[list[int], int]] = []

    def feed(self, model, ids, batch=0):
        if batch == 0:
            self.generated += 1
        return super().feed(model, ids, batch)

    def shift(self, model, n_keep, batch):
        freed = super().shift(model, n_keep, batch)
        self.shifts.append((self.tokens, self.generated + 1))
        return freed


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, tmp_path_factory):
    path = make_model(request.param, "tiny", tmp_path_factory.mktemp("shift") / f"{request.param}.gguf")
    with open_model(path) as mf:
        yield load_model(mf, options=ModelOptions(kv_type="f32")), Tokenizer.from_gguf(mf.gguf)


def cfg(n: int, **kw) -> GenerationConfig:
    # real batches: a position computes the same bit for bit in any batch (docs/conversations.md § Prefix reuse)
    return GenerationConfig(max_tokens=n, n_ctx=N_CTX, ignore_eos=True, prefill_batch=8, **kw)


def prompt_of(tok) -> list[int]:
    return tok.encode("The old mill stood by the river and", add_bos=False, special=False)


def test_a_generation_longer_than_the_context_keeps_going_as_a_fresh_run_would(arch_model):
    model, tok = arch_model
    prompt, session = prompt_of(tok), Watching()
    out = generate(model, tok, prompt, SamplingParams(), cfg(150, context_shift=True, n_keep=4), session=session)
    assert out.finish_reason == "length" and len(out.tokens) == 150
    assert out.timings["context_shifts"] == len(session.shifts) >= 2
    ends = [at for _, at in session.shifts[1:]] + [len(out.tokens)]
    for (kept, at), end in zip(session.shifts, ends):
        assert kept[:4] == prompt[:4] and len(kept) < N_CTX - 1  # n_keep held, room made
        fresh = generate(model, tok, kept + [out.tokens[at - 1]], SamplingParams(), cfg(end - at))
        assert fresh.tokens == out.tokens[at:end]


def test_without_a_shift_a_full_context_ends_the_reply_with_length(arch_model):
    model, tok = arch_model
    out = generate(model, tok, prompt_of(tok), SamplingParams(), cfg(150))
    assert out.finish_reason == "context" and FINISH_REASONS[out.finish_reason] == "length"
    assert len(prompt_of(tok)) + len(out.tokens) == N_CTX + 1  # every position used; the last token sampled, never fed


def test_n_keep_follows_llama_cpp(arch_model):
    model, tok = arch_model
    prompt = prompt_of(tok)
    whole = Watching()
    generate(model, tok, prompt, SamplingParams(), cfg(80, context_shift=True, n_keep=-1), session=whole)
    assert whole.shifts and all(kept[: len(prompt)] == prompt for kept, _ in whole.shifts)  # -1: the whole prompt
    with_bos = [tok.bos_id, *prompt] if tok.bos_id is not None else prompt
    none = Watching()
    generate(model, tok, with_bos, SamplingParams(), cfg(80, context_shift=True, n_keep=0), session=none)
    kept, _ = none.shifts[0]
    assert kept[0] == with_bos[0] and kept[1:] != with_bos[1 : len(kept)]  # only the BOS stays
    huge = Watching()  # more than the context: clamped to n_ctx - 4, still shifting
    out = generate(model, tok, prompt, SamplingParams(), cfg(80, context_shift=True, n_keep=10_000), session=huge)
    assert len(out.tokens) == 80 and huge.shifts


# deepseek4 in the slow tier: its shifts take ~55 s of the default tier on a 2-core AVX2 host
@pytest.fixture(scope="module", params=("gemma4", "gpt-oss", pytest.param("deepseek4", marks=pytest.mark.slow)))
def windowed_model(request, tmp_path_factory):
    """The tiny model with an 8-token window (its sliding layers' rings wrap inside N_CTX;
    deepseek4's keys on every layer and its compressor rows too)."""
    path = make_model(request.param, "tiny", tmp_path_factory.mktemp("swa") / "m.gguf", _overrides={"sliding_window": 8})
    with open_model(path) as mf:
        yield load_model(mf, options=ModelOptions(kv_type="f32")), Tokenizer.from_gguf(mf.gguf)


@pytest.mark.parametrize("n_keep", [0, pytest.param(4, marks=pytest.mark.slow)])  # 4: ~23 s
def test_a_shift_on_sliding_window_rings_gives_a_fresh_runs_tokens(windowed_model, n_keep):
    """Rings of 8 - 1 + 4 rows (prompt block 4) through a context of 64: with n_keep 0 the kept
    tail is recomputed from position 0; with n_keep 4 the rings no longer hold the window after
    the kept head, so head and tail are both recomputed. Every stretch between shifts equals a
    fresh run on the kept ids with a whole-context cache."""
    model, tok = windowed_model
    prompt, session = prompt_of(tok), Watching()
    session.cache = KVCache.for_spec(model.spec, N_CTX, "f32", prompt_block=4)
    out = generate(model, tok, prompt, SamplingParams(), cfg(150, context_shift=True, n_keep=n_keep), session=session)
    assert len(out.tokens) == 150 and len(session.shifts) >= 2
    assert session.cache.k[0].cap == 11 and session.cache.k[0].lo > n_keep  # the rings wrapped past the head
    ends = [at for _, at in session.shifts[1:]] + [len(out.tokens)]
    for (kept, at), end in zip(session.shifts, ends):
        assert kept[:n_keep] == prompt[:n_keep]
        fresh = generate(model, tok, kept + [out.tokens[at - 1]], SamplingParams(), cfg(end - at))
        assert fresh.tokens == out.tokens[at:end]


def test_n_keep_below_minus_one_is_refused():
    with pytest.raises(UserError, match="n_keep must be"):
        GenerationConfig(n_keep=-2)
