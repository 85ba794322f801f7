"""Speculative decoding (shared/text/speculate.py): the output with drafts is the
output without them, token for token, on every family, greedy and sampled, at any
acceptance; a rollback leaves the KV cache and the recurrent state as plain
decoding leaves them; the n-gram drafter proposes what followed the latest match.

CI time: four families at one width and acceptance in the default tier (a plain
one, a hybrid with a recurrent state, one with sliding-window rings, DeepSeek V4's
compressed attention), the others and widths 1-4, both acceptances, f32 weights
and every KV type behind -m slow."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.family_registry import ARCHES
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.speculate import NGramDrafter, ReplayDrafter, Speculation, WidthChooser, drafter_for
from moe_pipe.shared.text.tokenizer import Tokenizer

FAMILIES = ARCHES  # every family's GGUF arch (shared/family_registry.py)
PROMPT = "Once upon a time, there was a little fox who liked to run. Once upon a time"
N = 20


# -- the n-gram drafter -----------------------------------------------------------------


def brute_force_ngram(history: list[int], n: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the longest tail g-gram (max_n..min_n) seen earlier, its latest occurrence's continuation."""
    end = len(history)
    for g in range(min(max_n, end - 1), min_n - 1, -1):
        tail = history[end - g :]
        for s in range(end - g - 1, -1, -1):
            if history[s : s + g] == tail:
                return history[s + g : s + g + n]
    return []


def test_ngram_drafts_what_followed_the_latest_longest_match():
    d = NGramDrafter(max_n=3, min_n=2)
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # the tail 3-gram (5, 6, 7) occurs at 0: its continuation; the later (6, 7) at 5 is shorter
    assert d.propose(history, 3) == [8, 1, 6]
    assert d.propose([*history, 4], 2) == []  # (7, 4) and (6, 7, 4) never occurred


def test_ngram_index_grows_with_the_history_and_equals_the_definition():
    rng = random.Random(3)
    d = NGramDrafter(max_n=4, min_n=2)
    history: list[int] = []
    for _ in range(400):
        history.append(rng.randrange(6))
        assert d.propose(history, 4) == brute_force_ngram(history, 4, 4, 2), history
    # a history that is not a continuation (the next request) starts the index over
    assert d.propose([1, 2, 3, 1, 2], 2) == [3, 1]


def test_drafter_for_names_its_sources_and_reads_a_replay(tmp_path):
    assert isinstance(drafter_for("ngram"), NGramDrafter)
    assert drafter_for("none") is None
    with pytest.raises(UserError, match="unknown draft source"):
        drafter_for("mtpx")
    bad = tmp_path / "r.json"
    bad.write_text("{")
    with pytest.raises(UserError, match="cannot read the draft replay"):
        drafter_for("ngram", str(bad))


def test_replay_drafter_follows_the_continuation_and_corrupts_at_its_rate():
    ref = list(range(100, 160))
    d = ReplayDrafter(ref, accuracy=1.0)
    prompt = [1, 2, 3]
    d.start(prompt)
    assert d.propose([*prompt, ref[0]], 3) == ref[1:4]
    assert d.propose([*prompt, *ref[:10]], 2) == ref[10:12]
    d = ReplayDrafter(ref, accuracy=0.5, seed=1)
    d.start(prompt)
    got = [d.propose([*prompt, *ref[: i + 1]], 1) for i in range(50)]
    right = sum(g == [ref[i + 1]] for i, g in enumerate(got))
    assert 15 <= right <= 35  # half, within chance


def test_a_width_out_of_range_is_refused():
    with pytest.raises(UserError, match="draft width"):
        Speculation(Session(), NGramDrafter(), 9)


# -- the width chooser ----------------------------------------------------------------------


def drive(chooser: WidthChooser, accept: float, cost, passes: int = 300, seed: int = 0) -> list[int]:
    """The widths `chooser` picks when each draft is right with chance `accept` and a pass of r rows costs cost(r)."""
    rng = random.Random(seed)
    widths = []
    for _ in range(passes):
        w = chooser.choose()
        widths.append(w)
        chooser.passed(w + 1, cost(w + 1))
        kept = next((i for i in range(w) if rng.random() >= accept), w)
        if w:
            chooser.judged(w, kept)
    return widths


def test_the_chooser_drafts_wide_when_drafts_are_kept_and_passes_cheap():
    widths = drive(WidthChooser(4), 0.95, lambda r: 1.0 + 0.1 * (r - 1))
    assert widths[0] == 0  # a plain pass first: the price to beat
    assert sum(w == 4 for w in widths[-100:]) >= 90


def test_the_chooser_stops_drafting_when_drafts_are_wrong_and_probes_now_and_then():
    widths = drive(WidthChooser(4), 0.0, lambda r: 1.0 + 0.1 * (r - 1))
    tail = widths[-160:]
    assert sum(w > 0 for w in tail) <= 160 // WidthChooser.PROBE_EVERY + 1
    assert all(w <= 1 for w in tail)  # a probe is one draft more than the best, 0


def test_the_chooser_stops_drafting_when_wider_passes_cost_what_they_gain():
    """Miss-heavy: each row's experts are reads, so a pass of r rows costs ~r plain passes."""
    widths = drive(WidthChooser(4), 0.6, lambda r: float(r))
    assert sum(w > 0 for w in widths[-160:]) <= 160 // WidthChooser.PROBE_EVERY + 1


def drive_free(chooser: WidthChooser, accepts: list[float], cost, seed: int = 0) -> list[int]:
    """As `drive`, for a free drafter: every pass judges the widest proposal, drafted or not;
    pass i's drafts are right with chance accepts[i]."""
    rng = random.Random(seed)
    widths = []
    for accept in accepts:
        w = chooser.choose()
        widths.append(w)
        chooser.passed(w + 1, cost(w + 1))
        chooser.judged(chooser.most, next((i for i in range(chooser.most) if rng.random() >= accept), chooser.most))
    return widths


def test_a_free_drafter_is_judged_while_nothing_is_drafted_and_is_not_probed_in_vain():
    cheap = lambda r: 1.0 + 0.1 * (r - 1)  # noqa: E731
    chooser = WidthChooser(4, free=True)
    widths = drive_free(chooser, [0.0] * 300 + [0.95] * 100, cheap)
    assert widths[: WidthChooser.FIRST_PLAIN] == [0] * WidthChooser.FIRST_PLAIN
    assert not any(widths[140:300])  # no drafts once drafts are never kept: not even a probe
    turned = next(i for i in range(300, 400) if widths[i])
    assert turned < 300 + 10  # the text turned repetitive: seen at once, not at the next probe
    assert sum(w == 4 for w in widths[-60:]) >= 50


def test_the_chooser_prices_plain_again_while_drafting():
    """A plain pass's price from one lucky (or unlucky) pass would hold every decision after it."""
    chooser = WidthChooser(2, free=True)
    widths = drive_free(chooser, [1.0] * 300, lambda r: 1.0 + 0.5 * (r - 1))
    plain = [i for i, w in enumerate(widths) if w == 0]
    assert plain[: WidthChooser.FIRST_PLAIN] == list(range(WidthChooser.FIRST_PLAIN))
    later = plain[WidthChooser.FIRST_PLAIN :]
    assert later and len(later) <= 300 // WidthChooser.REPRICE_PLAIN + 1


def test_a_session_keeps_its_chooser_across_requests():
    session = Session()
    first = Speculation(session, NGramDrafter(), 2)
    assert first.chooser is not None and first.chooser.free
    first.chooser.passed(1, 0.5)
    first.chooser.judged(2, 2)
    again = Speculation(session, NGramDrafter(), 2)
    assert first.chooser is again.chooser
    assert again.chooser.cost == {1: 0.5}  # the prices stay; a free drafter's α are the new text's to show
    assert again.chooser.kept == [WidthChooser.FREE_PRIOR_KEPT] * 2 and not any(again.chooser.measured)
    assert Speculation(session, NGramDrafter(), 3).chooser is not first.chooser  # another width: measured afresh
    assert Speculation(Session(), NGramDrafter(), 2, adapt=False).chooser is None


def test_proposals_are_judged_against_what_followed():
    spec = Speculation(Session(), NGramDrafter(), 3)
    chooser = spec.chooser
    assert chooser is not None
    spec.proposals = [(5, [7, 8, 9]), (6, [8, 1, 1])]
    history = [0, 1, 2, 3, 4, 7]
    spec.judge_proposals(history)  # the first's first draft followed, its second is not known yet
    assert len(spec.proposals) == 2 and not any(chooser.measured)
    spec.judge_proposals(history + [8, 5])
    assert spec.proposals == []  # the first kept 2 of 3, the second 1 of 3
    told = WidthChooser(3, free=True)
    told.judged(3, 2)
    told.judged(3, 1)
    assert chooser.kept == told.kept and chooser.measured == told.measured == [True, True, True]


def test_the_adaptive_width_keeps_the_output(tiny_files):
    path = tiny_files("qwen3moe")
    plain, _, plain_session = run(path, max_tokens=40)
    got, timings, session = run(path, ReplayDrafter(plain, 0.9, seed=3), 4, max_tokens=40, adapt=True)
    assert got == plain and timings["draft_accepted"] > 0
    assert_same_cache(session, plain_session)


# -- the output is the plain output --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    return lambda arch, quant=None: _made(folder, arch, quant)


_MADE: dict = {}


def _made(folder, arch, quant):
    key = (arch, quant)
    if key not in _MADE:
        _MADE[key] = make_model(arch, "tiny", folder / f"{arch}-{quant or 'mix'}.gguf", quant=quant)
    return _MADE[key]


def run(path, drafter=None, width=0, kv="f32", temperature=0.0, seed=7, n_ctx=4096, max_tokens=N, context_shift=False, adapt=False):
    """(tokens, timings, session) of one generation on a fresh resident model."""
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        model = load_model(mf, options=ModelOptions(kv_type=kv))
        params = SamplingParams(temperature=temperature, seed=seed) if temperature else SamplingParams()
        cfg = GenerationConfig(
            max_tokens=max_tokens, ignore_eos=True, draft=width, draft_adapt=adapt, n_ctx=n_ctx, context_shift=context_shift
        )
        session = Session()
        prompt = tok.encode(PROMPT)
        g = generate(model, tok, prompt, params, cfg, session=session, drafter=drafter)
        return g.tokens, g.timings, session


def check_speculation(path, width, accuracy, kv="f32", temperature=0.0):
    plain, _, plain_session = run(path, kv=kv, temperature=temperature)
    got, timings, session = run(path, ReplayDrafter(plain, accuracy, seed=width), width, kv, temperature)
    assert got == plain
    assert timings["draft_n"] > 0
    if accuracy == 1.0:
        assert timings["draft_accepted"] == timings["draft_n"]  # every draft kept: no pass wasted
    else:
        assert 0 < timings["draft_accepted"] < timings["draft_n"]
    assert_same_cache(session, plain_session)


def assert_same_cache(got: Session, want: Session) -> None:
    """The KV rows of every held position and the recurrent state, as plain decoding left them."""
    assert got.tokens == want.tokens and got.n == want.n and not got.redo
    a, b = got.cache, want.cache
    for ra, rb in zip(a.rows(), b.rows()):
        lo = max(ra.lo, 0) if ra.window else 0
        for xa, xb in zip(ra.export(lo, got.n), rb.export(lo, want.n)):
            np.testing.assert_array_equal(xa, xb)
    if a.state is not None:
        for i in a.state.conv:
            np.testing.assert_array_equal(a.state.conv[i], b.state.conv[i])
            np.testing.assert_array_equal(a.state.delta[i], b.state.delta[i])


DEFAULT_TIER = ("qwen3moe", "qwen35moe", "gemma4", "deepseek4")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=[] if a in DEFAULT_TIER else [pytest.mark.slow]) for a in FAMILIES])
def test_speculative_greedy_output_is_the_plain_output(tiny_files, arch):
    """Width 3, half the drafts wrong: accepted runs, rollbacks mid-pass and fully kept passes all occur."""
    check_speculation(tiny_files(arch), 3, 0.6)


@pytest.mark.slow
@pytest.mark.parametrize("arch,width,accuracy", list(itertools.product(FAMILIES, (1, 2, 4), (1.0, 0.5))))
def test_speculative_output_at_every_width_and_acceptance(tiny_files, arch, width, accuracy):
    check_speculation(tiny_files(arch), width, accuracy)


# In the slow tier (~20 s of the default tier on a 2-core AVX2 host); the default tier keeps
# sampled speculation through the MTP block (tests/test_mtp.py)
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe", "gemma4"])
def test_speculative_sampled_output_is_the_plain_output_with_the_same_seed(tiny_files, arch):
    """Sampling each token from its row and keeping the draft when they agree spends one draw per
    emitted token, as plain decoding does: the same seed gives the same tokens (the speculative-
    sampling rule for a certain draft, exactly: kept with probability p(d), else drawn from p without d)."""
    check_speculation(tiny_files(arch), 2, 0.6, temperature=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("arch,kv", list(itertools.product(FAMILIES, ("f16", "q8_0"))))
def test_speculative_output_on_every_kv_type(tiny_files, arch, kv):
    """q8_0 attention takes a verify pass's rows one at a time (KVCache.rows_alone), so they round as decode steps do."""
    check_speculation(tiny_files(arch), 3, 0.6, kv=kv)


@pytest.mark.parametrize("arch", ["gemma4"])
def test_q8_0_kv_verify_rows_are_decode_steps(tiny_files, arch):
    check_speculation(tiny_files(arch), 3, 0.6, kv="q8_0")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "deepseek2"])
def test_speculative_output_on_f32_weights(tiny_files, arch):
    check_speculation(tiny_files(arch, "F32"), 3, 0.6)


def _counting(verify, rows: list[int]):
    """`verify`, each pass's row count appended to `rows`."""

    def counted(tokens, cache, redo=0):
        rows.append(len(tokens))
        return verify(tokens, cache, redo)

    return counted


@pytest.mark.parametrize("arch", ["qwen35moe", pytest.param("lfm2moe", marks=pytest.mark.slow)])
def test_a_rollback_redoes_only_the_kept_drafts_never_the_certain_rows(tiny_files, arch):
    """A recurrent state goes back to where a pass's certain rows (redo rows and the decoded
    token) left it, copied inside the pass: with every draft wrong no pass carries a redo row,
    and with some kept a pass carries at most the drafts kept before it (the rows stay few
    however long the run), the output and cache the plain ones."""
    path = tiny_files(arch)
    plain, _, plain_session = run(path, max_tokens=40)
    for accuracy, most in ((0.0, 3), (0.7, 5)):
        rows: list[int] = []
        with open_model(path) as mf:
            tok = Tokenizer.from_gguf(mf.gguf)
            model = load_model(mf, options=ModelOptions(kv_type="f32"))
            model.verify = _counting(model.verify, rows)  # type: ignore[method-assign]
            cfg = GenerationConfig(max_tokens=40, ignore_eos=True, draft=2, draft_adapt=False, n_ctx=4096)
            session = Session()
            g = generate(
                model, tok, tok.encode(PROMPT), SamplingParams(), cfg, session=session, drafter=ReplayDrafter(plain, accuracy, seed=4)
            )
        assert g.tokens == plain and rows and max(rows) <= most, rows
        assert_same_cache(session, plain_session)


@pytest.mark.parametrize("arch", ["qwen35moe", pytest.param("qwen3moe", marks=pytest.mark.slow)])
def test_drafts_stop_at_the_context_end_and_across_a_context_shift(tiny_files, arch):
    """A pass never drafts past n_ctx; with a context shift the tokens a rollback holds back
    (qwen35moe's redo) are run before the shift keeps them."""
    path = tiny_files(arch)
    for shift in (False, True):
        plain, pt, _ = run(path, n_ctx=40, max_tokens=30, context_shift=shift)
        got, gt, _ = run(path, ReplayDrafter(plain, 0.6, seed=1), 4, n_ctx=40, max_tokens=30, context_shift=shift)
        assert got == plain and gt["context_shifts"] == pt["context_shifts"]


def test_ngram_drafts_on_a_repetitive_continuation_keep_the_output(tiny_files):
    """The tiny model falls into loops: n-gram drafts are then mostly right."""
    path = tiny_files("qwen3moe")
    plain, _, _ = run(path, max_tokens=40)
    got, timings, _ = run(path, NGramDrafter(), 4, max_tokens=40)
    assert got == plain
    assert timings["draft_passes"] > 0


# -- in the streaming pipeline -----------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen35moe", pytest.param("qwen3moe", marks=pytest.mark.slow)])
def test_the_pipeline_speculates_with_streamed_experts_and_keeps_the_tokens(tiny_files, arch, tmp_path):
    """The compute process verifies drafts on experts read into the least cache: the resident
    reference's tokens, fewer passes than tokens, each verify pass's drafts in its CSV row."""
    import json

    from moe_pipe.shared.telemetry import read_csv

    from .test_pipeline import _budget_mb, run_pipeline, with_reference

    path, prompt, reference, sizes = with_reference(tiny_files(arch), top_ks=(None,))
    replay = tmp_path / "drafts.json"
    replay.write_text(json.dumps({"tokens": reference[None], "accuracy": 0.7, "seed": 2}))
    csv = tmp_path / "run.csv"
    tokens, timings, _ = run_pipeline(
        path,
        prompt,
        **{
            "cache.cache_mb": _budget_mb(sizes, "min", None),
            "compute.draft": 3,
            "compute.draft_adapt": False,
            "compute.draft_replay": str(replay),
            "telemetry.csv": str(csv),
        },
    )
    assert tokens == reference[None]
    _, records = read_csv(csv)
    assert 0 < timings["draft_accepted"] < timings["draft_n"] == sum(r.drafted for r in records)
    assert timings["draft_accepted"] == sum(r.accepted for r in records)  # each pass's record says how many of its drafts were kept
    assert len(records) < len(tokens)  # the kept drafts needed no pass of their own
    assert all(r.accepted <= r.drafted for r in records)
