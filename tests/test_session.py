"""Prefix reuse and saved sessions (shared/model/session.py, docs/conversations.md):
a request computes only what its prompt does not share with the KV cache of
the last one, and gives the tokens a fresh run gives (greedy, every
architecture); conversations interleaved on one session never share state;
a saved session restores in a fresh model and continues as if never stopped;
a file of another model, truncated, of another version or kv_type is refused.
On sliding-window rings (gemma4, gpt-oss): what a prefix can keep past the
window, and a saved session that holds only the rings' positions."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.experts.directio import model_identity
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.blocks import KVCache
from moe_pipe.shared.model.load import ModelOptions, load_model
from moe_pipe.shared.model.session import SESSION_MAGIC, Session, load_session, save_session, slot_action
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.tokenizer import Tokenizer

ARCHS = ("qwen3moe", "gpt-oss", "gemma4")
GREEDY = SamplingParams()


class Counting:
    """The model, counting the tokens each prefill and decode computes."""

    def __init__(self, model):
        self.model, self.prefilled, self.decoded = model, 0, 0

    def new_cache(self, n_ctx):
        return self.model.new_cache(n_ctx)

    def prefill(self, tokens, cache, batch=64):
        self.prefilled += len(tokens)
        return self.model.prefill(tokens, cache, batch=batch)

    def decode_one(self, token, cache):
        self.decoded += 1
        return self.model.decode_one(token, cache)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sess")
    return {arch: make_model(arch, "tiny", root / f"{arch}.gguf") for arch in ARCHS} | {
        "other": make_model("qwen3moe", "tiny", root / "other.gguf", seed=7)
    }


@pytest.fixture(scope="module")
def loaded(files):
    """arch -> (model file, model, tokenizer, identity), kept open for the module."""
    out = {}
    for arch in (*ARCHS, "other"):
        mf = open_model(files[arch])
        out[arch] = (mf, load_model(mf, options=ModelOptions(kv_type="f32")), Tokenizer.from_gguf(mf.gguf), model_identity(mf.gguf.paths))
    yield out
    for mf, *_ in out.values():
        mf.close()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_bos=False, special=False)


def run(model, tok, prompt, n, session=None, **kw):
    """Greedy, one position per forward pass. Prefill rounds a batch's
    activations differently from one row at a time (the integer prefill), and
    a random tiny model's best logits are near ties; prefix reuse moves where
    batches split, so with batches "the same tokens" would test numerics. One
    position per pass computes every position the same way in both runs: any
    difference left is state that leaked."""
    cfg = GenerationConfig(max_tokens=n, n_ctx=256, ignore_eos=True, prefill_batch=kw.pop("prefill_batch", 1), **kw)
    return generate(model, tok, prompt, GREEDY, cfg, session=session)


@pytest.mark.parametrize("arch", ARCHS)
def test_second_turn_computes_only_its_new_tokens_and_equals_a_fresh_run(loaded, arch):
    _, model, tok, _ = loaded[arch]
    counting, session = Counting(model), Session()
    first = ids(tok, "The old mill stood by the river and")
    turn1 = run(counting, tok, first, 12, session)
    assert turn1.timings["prompt_cached"] == 0 and counting.prefilled == len(first)
    second = first + turn1.tokens + ids(tok, " then the miller said")
    counting.prefilled = 0
    turn2 = run(counting, tok, second, 12, session)
    held = len(first) + len(turn1.tokens) - 1  # the last sampled token was never fed
    assert turn2.timings["prompt_cached"] == held
    assert counting.prefilled == len(second) - held  # only the new tokens
    assert turn2.tokens == run(model, tok, second, 12).tokens  # a fresh cache: the same tokens
    assert session.tokens == second + turn2.tokens[:-1]


def test_whole_prompt_cached_recomputes_only_its_last_token(loaded):
    _, model, tok, _ = loaded["qwen3moe"]
    counting, session = Counting(model), Session()
    prompt = ids(tok, "Once upon a time there was")
    a = run(counting, tok, prompt, 8, session)
    counting.prefilled = 0
    b = run(counting, tok, prompt, 8, session)
    assert b.timings["prompt_cached"] == len(prompt) - 1 and counting.prefilled == 1
    assert a.tokens == b.tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_with_real_batches_reuse_keeps_every_shared_position_and_is_exact(files, arch, kv_type):
    """Prompts in batches of 4 and a reply decoded one token at a time, then a
    turn that shares all of it but the last token: every shared position is
    kept (none dropped to batch boundaries) and the logits equal a fresh run's
    bit for bit, because each position is computed alike in any batch
    (attention row by row, docs/kernels.md § Attention; int8 GEMM rows equal
    matvec, docs/kernels.md). The default f16 cache and f32 both."""
    with open_model(files[arch]) as mf:
        model, tok = load_model(mf, options=ModelOptions(kv_type=kv_type)), Tokenizer.from_gguf(mf.gguf)
        system = ids(tok, "You are a terse assistant who answers about mills and rivers only.")
        first = system + ids(tok, " Q: what is a mill?")
        session = Session()
        reply = run(model, tok, first, 6, session, prefill_batch=4)
        prompt = first + reply.tokens + ids(tok, " Q: where is the river?")
        again = run(model, tok, prompt, 6, session, prefill_batch=4)
        assert again.timings["prompt_cached"] == len(first) + len(reply.tokens) - 1
        fresh = run(model, tok, prompt, 6, prefill_batch=4)
        assert again.tokens == fresh.tokens
        cont = session.feed(model, again.tokens[-1:])
        ref = Session()
        ref.cache_for(model, 256)
        assert np.array_equal(cont, ref.feed(model, prompt + again.tokens, batch=7))


def test_a_q8_0_cache_is_reused_in_whole_batches(files):
    """q8_0's batched attention rounds unlike one row's: the kept prefix is cut to
    whole prefill batches, and the rest runs in the batches a fresh run uses."""
    with open_model(files["qwen3moe"]) as mf:
        model, tok = load_model(mf, options=ModelOptions(kv_type="q8_0")), Tokenizer.from_gguf(mf.gguf)
        system = ids(tok, "You are a terse assistant who answers about mills and rivers only.")
        session = Session()
        run(model, tok, system + ids(tok, " Q: what is a mill?"), 6, session, prefill_batch=4)
        prompt = system + ids(tok, " Q: where is the river?")
        shared = next(i for i, (a, b) in enumerate(zip(system + ids(tok, " Q: what is a mill?"), prompt)) if a != b)
        again = run(model, tok, prompt, 6, session, prefill_batch=4)
        assert again.timings["prompt_cached"] == shared - shared % 4 > 0
        assert again.tokens == run(model, tok, prompt, 6, prefill_batch=4).tokens


def test_cache_prompt_false_and_an_unrelated_prompt_start_from_position_zero(loaded):
    _, model, tok, _ = loaded["qwen3moe"]
    counting, session = Counting(model), Session()
    prompt = ids(tok, "Once upon a time there was")
    run(counting, tok, prompt, 4, session)
    counting.prefilled = 0
    again = run(counting, tok, prompt, 4, session, cache_prompt=False)
    assert again.timings["prompt_cached"] == 0 and counting.prefilled == len(prompt)
    other = ids(tok, "Zebras graze")
    assert other[0] != prompt[0]
    assert run(model, tok, other, 4, session).timings["prompt_cached"] == 0


def test_interleaved_conversations_give_exactly_what_each_gives_alone(loaded):
    _, model, tok, _ = loaded["qwen3moe"]

    def conversation(session, opening, follow):
        first = run(model, tok, opening, 10, session)
        second = run(model, tok, opening + first.tokens + follow, 10, session)
        return first, second

    a_open, a_follow = ids(tok, "The old mill stood by the river"), ids(tok, " and the wheel")
    b_open, b_follow = ids(tok, "In the city of brass the"), ids(tok, " merchants sang")
    alone_a = [g.tokens for g in conversation(Session(), a_open, a_follow)]
    alone_b = [g.tokens for g in conversation(Session(), b_open, b_follow)]
    shared = Session()
    a1 = run(model, tok, a_open, 10, shared)
    b1 = run(model, tok, b_open, 10, shared)
    a2 = run(model, tok, a_open + a1.tokens + a_follow, 10, shared)
    b2 = run(model, tok, b_open + b1.tokens + b_follow, 10, shared)
    assert [a1.tokens, a2.tokens] == alone_a
    assert [b1.tokens, b2.tokens] == alone_b


class FailsOnce:
    """The model, raising in its second prefill pass once (a read error half way through a prompt)."""

    def __init__(self, model):
        self.model, self.calls, self.failed = model, 0, False

    def new_cache(self, n_ctx):
        return self.model.new_cache(n_ctx)

    def prefill(self, tokens, cache, batch=64):
        for s in range(0, len(tokens), batch):
            self.calls += 1
            if self.calls == 2 and not self.failed:
                self.failed = True
                raise OSError("read failed")
            logits = self.model.prefill(tokens[s : s + batch], cache, batch=batch)
        return logits

    def decode_one(self, token, cache):
        return self.model.decode_one(token, cache)


def test_a_step_that_fails_half_way_leaves_only_what_was_computed(loaded):
    _, model, tok, _ = loaded["qwen3moe"]
    prompt = ids(tok, "The old mill stood by the river and the wheel turned all day long")
    flaky, session = FailsOnce(model), Session()
    with pytest.raises(OSError):
        run(flaky, tok, prompt, 6, session)
    assert session.tokens == prompt[:1]  # the first pass is held, nothing of the failed one
    again = run(flaky, tok, prompt, 6, session)
    assert again.timings["prompt_cached"] == 1
    assert again.tokens == run(model, tok, prompt, 6).tokens


# -- saved sessions ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_save_restore_in_a_fresh_model_continues_as_if_never_stopped(loaded, files, arch, tmp_path):
    _, model, tok, identity = loaded[arch]
    prompt, n = ids(tok, "The old mill stood by the river and"), 10
    whole = run(model, tok, prompt, 2 * n).tokens
    session = Session()
    head = run(model, tok, prompt, n, session).tokens
    path = tmp_path / "s.bin"
    written = save_session(path, session, identity, arch)
    assert written == path.stat().st_size and not list(tmp_path.glob(".*tmp"))
    with open_model(files[arch]) as mf:  # a fresh model and cache
        fresh = load_model(mf, options=ModelOptions(kv_type="f32"))
        restored = load_session(path, fresh, 256, model_identity(mf.gguf.paths))
        assert restored.tokens == prompt + head[:-1]
        counting = Counting(fresh)
        tail = run(counting, tok, prompt + head, n, restored)
    assert head + tail.tokens == whole
    assert counting.prefilled == 1  # only the token sampled before the save


def test_slot_actions_report_llama_cpp_figures(loaded, tmp_path):
    _, model, tok, identity = loaded["qwen3moe"]
    session = Session()
    run(model, tok, ids(tok, "Once upon a time"), 5, session)
    held = session.n
    saved = slot_action(session, "save", str(tmp_path / "a.bin"), model, 256, identity)
    assert saved["n_saved"] == held and saved["n_written"] == (tmp_path / "a.bin").stat().st_size
    assert slot_action(session, "erase", "", model, 256, identity)["n_erased"] == held and session.n == 0
    restored = slot_action(session, "restore", str(tmp_path / "a.bin"), model, 256, identity)
    assert restored["n_restored"] == held and session.n == held
    with pytest.raises(UserError, match="unknown slot action"):
        slot_action(session, "load", "", model, 256, identity)


@pytest.fixture
def saved(loaded, tmp_path):
    _, model, tok, identity = loaded["qwen3moe"]
    session = Session()
    run(model, tok, ids(tok, "Once upon a time"), 6, session)
    path = tmp_path / "s.bin"
    save_session(path, session, identity, "qwen3moe")
    return path


def test_a_file_of_another_model_is_refused_and_the_session_kept(loaded, saved):
    _, other, tok, identity = loaded["other"]
    session = Session()
    run(other, tok, ids(tok, "Zebras graze"), 3, session)
    before = session.tokens
    with pytest.raises(UserError, match="saved with another model file"):
        slot_action(session, "restore", str(saved), other, 256, identity)
    assert session.tokens == before  # a refused file leaves the session as it was


def test_a_truncated_file_is_refused(loaded, saved):
    _, model, _, identity = loaded["qwen3moe"]
    data = saved.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20, 5):
        saved.write_bytes(data[:cut])
        with pytest.raises(UserError, match="truncated") as err:
            load_session(saved, model, 256, identity)
        assert "\n" not in str(err.value)


def test_another_version_kv_type_or_kind_of_file_is_refused(loaded, files, saved):
    _, model, _, identity = loaded["qwen3moe"]
    data = saved.read_bytes()
    saved.write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    with pytest.raises(UserError, match="version 99; this moe-pipe reads version 2"):
        load_session(saved, model, 256, identity)
    # Version 1 stored every layer's rows for all N positions; a sliding layer now keeps a ring.
    saved.write_bytes(data[:8] + struct.pack("<I", 1) + data[12:])
    with pytest.raises(UserError, match="is version 1; this moe-pipe reads version 2") as err:
        load_session(saved, model, 256, identity)
    assert "\n" not in str(err.value)
    saved.write_bytes(data)
    with open_model(files["qwen3moe"]) as mf:
        f16 = load_model(mf, options=ModelOptions(kv_type="f16"))
        with pytest.raises(UserError, match="stores its KV cache as f32 but this model runs with f16"):
            load_session(saved, f16, 256, identity)
    with pytest.raises(UserError, match="more than fit a context of 8"):
        load_session(saved, model, 8, identity)
    saved.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(UserError, match="not a moe-pipe session file"):
        load_session(saved, model, 256, identity)
    assert data.startswith(SESSION_MAGIC)


def test_a_save_that_cannot_be_written_leaves_nothing(loaded, tmp_path):
    _, model, tok, identity = loaded["qwen3moe"]
    session = Session()
    with pytest.raises(UserError, match="no session to save"):
        save_session(tmp_path / "x.bin", session, identity)
    run(model, tok, ids(tok, "Once"), 2, session)
    with pytest.raises(UserError, match="cannot write the session file"):
        save_session(tmp_path / "missing" / "x.bin", session, identity)
    assert list(tmp_path.iterdir()) == []


# -- sliding-window rings ------------------------------------------------------------

WINDOWED = ("gemma4", "gpt-oss")
BLOCK = 4  # the rings' prompt block: 8-token windows keep 11 rows


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """arch -> (model file, model, tokenizer, identity): the tiny model with an 8-token window."""
    root, out = tmp_path_factory.mktemp("swa"), {}
    for arch in WINDOWED:
        mf = open_model(make_model(arch, "tiny", root / f"{arch}.gguf", _overrides={"sliding_window": 8}))
        out[arch] = (mf, load_model(mf, options=ModelOptions(kv_type="f32")), Tokenizer.from_gguf(mf.gguf), model_identity(mf.gguf.paths))
    yield out
    for mf, *_ in out.values():
        mf.close()


def ring_session(model, n_ctx: int = 256) -> Session:
    """A session whose sliding layers keep rings of 8 - 1 + BLOCK rows (the engine's block is 512)."""
    return Session(KVCache.for_spec(model.spec, n_ctx, model.kv_type, prompt_block=BLOCK))


@pytest.mark.parametrize("arch", WINDOWED)
def test_reuse_past_the_window_keeps_what_the_rings_hold_and_recomputes_the_rest(windowed, arch):
    _, model, tok, _ = windowed[arch]
    counting, session = Counting(model), ring_session(model)
    first = ids(tok, "The old mill stood by the river and the wheel turned")
    turn1 = run(counting, tok, first, 12, session, prefill_batch=8)
    ring = session.cache.k[0]
    assert ring.cap == 8 - 1 + BLOCK and session.n > 2 * ring.cap  # the rings wrapped
    # A turn that extends all the cache holds keeps all of it: the rings hold the window before it.
    second = first + turn1.tokens + ids(tok, " then the miller said")
    turn2 = run(counting, tok, second, 12, session, prefill_batch=8)
    assert turn2.timings["prompt_cached"] == len(first) + len(turn1.tokens) - 1
    assert turn2.tokens == run(model, tok, second, 12, prefill_batch=8).tokens  # a fresh whole-context cache
    # Stepping back up to one prompt block keeps the prefix; one more, and the window rows before
    # it were overwritten: the prompt runs from position 0 (llama.cpp's SWA cache does the same).
    held = session.tokens
    for back, kept in ((BLOCK, len(held) - BLOCK), (BLOCK + 1, 0)):
        prompt = held[: len(held) - back] + ids(tok, " Zebras graze")
        counting.prefilled = 0
        again = run(counting, tok, prompt, 8, session, prefill_batch=8)
        assert again.timings["prompt_cached"] == kept and counting.prefilled == len(prompt) - kept
        assert again.tokens == run(model, tok, prompt, 8, prefill_batch=8).tokens
        held = session.tokens
    # The same request again (regenerate): a reply longer than a block moved the rings past it.
    counting.prefilled = 0
    assert run(counting, tok, prompt, 8, session, prefill_batch=8).timings["prompt_cached"] == 0


class Stopped(Exception):
    pass


class StopsOnce:
    """A layer observer that stops the next prompt pass after its first layer, once (a Stop mid-prompt)."""

    def __init__(self):
        self.armed = False

    def __call__(self, layer: int, tokens: int) -> None:
        if self.armed and tokens > 1:
            self.armed = False
            raise Stopped


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_prompt_stopped_after_overwriting_a_ring_is_recomputed_not_reused(windowed, arch, tmp_path):
    mf, _, tok, identity = windowed[arch]
    stop = StopsOnce()
    model = load_model(mf, options=ModelOptions(kv_type="f32", layer_observer=stop))
    session = ring_session(model)
    first = ids(tok, "The old mill stood by the river and the wheel turned")
    reply = run(model, tok, first, 6, session, prefill_batch=16)
    prompt = first + reply.tokens + ids(tok, " then the miller said that the river was high")
    stop.armed = True
    with pytest.raises(Stopped):
        run(model, tok, prompt, 6, session, prefill_batch=16)  # layer 0 stored its new rows in blocks of 4
    assert session.tokens == first + reply.tokens[:-1]  # the stopped pass is not counted...
    with pytest.raises(UserError, match="no session to save") as err:  # ...but it overwrote window rows
        save_session(tmp_path / "s.bin", session, identity, arch)
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())
    again = run(model, tok, prompt, 6, session, prefill_batch=16)
    assert again.timings["prompt_cached"] == 0  # from position 0, exactly
    assert again.tokens == run(model, tok, prompt, 6, prefill_batch=16).tokens


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_saved_ring_session_restores_into_any_cache_and_continues_as_if_never_stopped(windowed, arch, tmp_path):
    _, model, tok, identity = windowed[arch]
    prompt, n = ids(tok, "The old mill stood by the river and"), 12
    whole = run(model, tok, prompt, 2 * n, prefill_batch=8).tokens
    session = ring_session(model)
    head = run(model, tok, prompt, n, session, prefill_batch=8).tokens
    path = tmp_path / "s.bin"
    written = save_session(path, session, identity, arch)
    # The sliding layers wrote only their rings' 11 positions, the others all of them.
    rows = session.cache.rows()
    assert written < sum(r.data.nbytes // r.cap * session.n for r in rows)
    assert written > sum(r.data.nbytes // r.cap * (11 if r.window else session.n) for r in rows)
    for into in (None, ring_session(model).cache):  # the engine's cache (no ring wraps at 256), or rings
        restored = load_session(path, model, 256, identity, into=into)
        assert restored.tokens == prompt + head[:-1]
        counting = Counting(model)
        tail = run(counting, tok, prompt + head, n, restored, prefill_batch=8)
        assert head + tail.tokens == whole and counting.prefilled == 1


@pytest.mark.parametrize("arch", WINDOWED)
def test_a_prefix_shared_from_another_session_is_kept_by_reuse_and_exact(windowed, arch):
    """What a slot takes from another (Session.share_from, procs/slots.py): the other session's
    rings hold the window before the shared prefix, so the prefix is copied, generate keeps all
    of it and computes only the rest, and the tokens are a fresh run's. Once the other session
    has gone on more than a block past the prefix, it has nothing to give (`reusable` 0)."""
    _, model, tok, _ = windowed[arch]
    donor, mine, counting = ring_session(model), ring_session(model), Counting(model)
    system = ids(tok, "The old mill stood by the river and the wheel turned all day long")
    first = system + ids(tok, " and")
    run(model, tok, first, 1, donor, prefill_batch=8)  # holds `first` (its one output token never ran)
    prompt = system + ids(tok, " Zebras graze")
    n = donor.reusable(prompt)
    assert n == len(system) and donor.n - n <= BLOCK and mine.reusable(prompt) == 0
    mine.share_from(donor, n, model, 256)
    got = run(counting, tok, prompt, 8, mine, prefill_batch=8)
    assert got.timings["prompt_cached"] == n and counting.prefilled == len(prompt) - n
    assert got.tokens == run(model, tok, prompt, 8, prefill_batch=8).tokens
    run(model, tok, first + ids(tok, " the miller sang"), 4, donor, prefill_batch=8)  # it goes on past the prefix
    assert donor.n - n > BLOCK and donor.reusable(prompt) == 0
    with pytest.raises(ValueError, match="rings no longer hold"):
        ring_session(model).share_from(donor, n, model, 256)
