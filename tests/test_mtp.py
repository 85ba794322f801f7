"""The NextN/MTP block as a drafter (shared/model/mtp.py, shared/text/speculate.py
MtpDrafter): its guesses are the block run from scratch over the conversation's pairs
(h_j, t_{j+1}), however the passes, rollbacks and requests came; the output with its
drafts is the output without them; a file without the block is refused in one line.

Random weights make the block's guesses almost always wrong, so `Mixed` keeps the
drafter's own bookkeeping running while it hands the verifier a recorded greedy
continuation at some positions: kept drafts, rollbacks mid-pass and redo rows all occur.

CI time: qwen35moe (the hybrid, its recurrent redo) in the default tier, glm4moe and
bailingmoe3 behind -m slow."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moe_pipe.shared import quant
from moe_pipe.shared.config import load_config
from moe_pipe.shared.errors import ConfigError, UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.base import ModelOptions
from moe_pipe.shared.model.load import load_model
from moe_pipe.shared.model.mtp import NextN, NextNStep, SubsetHead
from moe_pipe.shared.model.session import Session
from moe_pipe.shared.model.weights import QWeight
from moe_pipe.shared.text.generate import GenerationConfig, generate
from moe_pipe.shared.text.sampling import SamplingParams
from moe_pipe.shared.text.speculate import MtpDrafter, drafter_for
from moe_pipe.shared.text.tokenizer import Tokenizer

PROMPT = "Once upon a time, there was a little fox who liked to run. Once upon a time"
SUBSET = 512  # compute.draft_vocab in the subset tests: a quarter of the tiny vocabulary
MTP_FAMILIES = ["qwen35moe", pytest.param("glm4moe", marks=pytest.mark.slow), pytest.param("bailingmoe3", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    made: dict = {}

    def get(arch, quant=None):
        if (arch, quant) not in made:
            made[arch, quant] = make_model(arch, "tiny", folder / f"{arch}-{quant or 'mix'}.gguf", quant=quant, mtp=True)
        return made[arch, quant]

    return get


class Mixed:
    """The MTP drafter's proposals recorded as it makes them; what the verifier gets is the
    recorded plain continuation where `rng` says so (drafts then kept), else the block's."""

    free = False

    def __init__(self, inner: MtpDrafter, plain: list[int], prompt_len: int, right: float, seed: int = 0):
        self.inner, self.plain, self.base, self.right = inner, plain, prompt_len, right
        self.rng = np.random.default_rng(seed)
        self.proposals: list[tuple[list[int], list[int]]] = []  # (history, the block's drafts)

    def start(self, prompt):
        self.inner.start(prompt)

    def propose(self, history, n):
        own = self.inner.propose(history, n)
        self.proposals.append((list(history), own))
        at = len(history) - self.base
        truth = self.plain[at : at + len(own)]
        return [t if self.rng.random() < self.right else d for t, d in zip(truth, own)]


def generation(model, tok, session, prompt, width=0, drafter=None, temperature=0.0, max_tokens=24, n_ctx=512):
    params = SamplingParams(temperature=temperature, seed=5) if temperature else SamplingParams()
    cfg = GenerationConfig(max_tokens=max_tokens, ignore_eos=True, draft=width, draft_adapt=False, n_ctx=n_ctx)
    return generate(model, tok, prompt, params, cfg, session=session, drafter=drafter)


def scratch_drafts(path, history: list[int], n: int, subset=None) -> list[int]:
    """The block's n guesses after `history`, from nothing: a fresh model runs history[:-1]
    (its final hidden rows caught), a fresh block cache takes every pair at once, then chains;
    each guess the argmax over the whole vocabulary, or over the ids `subset` alone."""

    def guess(logits):
        if subset is None:
            return int(np.argmax(logits))
        kept = np.full_like(logits, -np.inf)
        kept[subset] = logits[subset]
        return int(np.argmax(kept))

    with open_model(path) as mf:
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        caught = []
        model.hidden_sink = lambda start, tokens, hidden, certain: caught.append(hidden)
        p = len(history) - 1
        model.forward(history[:p], model.new_cache(1024))
        head = NextN(model)
        cache = head.new_cache(1024)
        step = head.step(np.array(history[1 : p + 1]), np.concatenate(caught), cache)
        drafts = [guess(head.logits(step))]
        while len(drafts) < n:
            step = head.step(np.array(drafts[-1:]), step.feed[-1:], cache)
            drafts.append(guess(head.logits(step)))
        return drafts


def plain_conversation(mf, tok, prompt):
    """Two plain greedy requests on one session, the second extending the first's
    conversation: (the first reply, the second prompt, the second reply)."""
    model = load_model(mf, options=ModelOptions(kv_type="f32"))
    session = Session()
    first = generation(model, tok, session, prompt).tokens
    second_prompt = prompt + first + tok.encode(" and then")
    return first, second_prompt, generation(model, tok, session, second_prompt).tokens


@pytest.mark.parametrize("arch", MTP_FAMILIES)
def test_mtp_drafts_are_the_block_run_from_scratch_and_keep_the_output(mtp_file, arch):
    """Two requests on one session (the second extends the first's conversation), width 3,
    half the drafts the right ones: every proposal equals the block run from scratch over
    the pairs so far, and the tokens are the plain tokens."""
    path = mtp_file(arch)
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        first, second_prompt, second = plain_conversation(mf, tok, prompt)

        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        session = Session()
        mixed = Mixed(drafter_for("mtp", model=model, session=session, n_ctx=512), first, len(prompt), 0.5)
        got = generation(model, tok, session, prompt, 3, mixed)
        assert got.tokens == first and got.timings["draft_accepted"] > 0
        assert mixed.inner.subset is None  # draft_vocab 0: the whole head, as before it existed
        again = Mixed(drafter_for("mtp", model=model, session=session, n_ctx=512), second, len(second_prompt), 0.5, seed=1)
        assert again.inner is mixed.inner  # the block's cache followed the session
        got2 = generation(model, tok, session, second_prompt, 3, again)
        assert got2.tokens == second and got2.timings["prompt_cached"] > 0
    proposals = mixed.proposals + again.proposals
    assert all(own for _, own in proposals)  # no gap: every pass drafted
    for history, own in proposals[:: max(1, len(proposals) // 6)] + proposals[-1:]:
        assert own == scratch_drafts(path, history, len(own)), len(history)


def with_the_conversation(history) -> np.ndarray:
    """The subset a proposal after `history` guesses from: the SUBSET lowest ids and the conversation's."""
    return np.union1d(np.arange(SUBSET), np.asarray(history))


# In the slow tier on every family (~26 s of the default tier on a 2-core AVX2 host); the
# default tier keeps the block's drafts and its sampled output on qwen35moe
@pytest.mark.slow
@pytest.mark.parametrize("arch", MTP_FAMILIES)
def test_subset_drafts_are_the_block_restricted_to_the_subset_and_keep_the_output(mtp_file, arch):
    """compute.draft_vocab SUBSET, two requests on one session as above: every proposal is the
    block run from scratch with each guess the argmax over the low ids and the conversation's
    (both requests' prompts and output) alone, some of them guesses the whole vocabulary would
    not make; the tokens are the plain tokens. A conversation that reuses no prefix starts the
    conversation's ids again."""
    path = mtp_file(arch)
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        first, second_prompt, second = plain_conversation(mf, tok, prompt)

        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        session = Session()

        def drafter():
            return drafter_for("mtp", model=model, session=session, n_ctx=512, vocab=SUBSET)

        mixed = Mixed(drafter(), first, len(prompt), 0.5)
        got = generation(model, tok, session, prompt, 3, mixed)
        assert got.tokens == first and got.timings["draft_accepted"] > 0
        again = Mixed(drafter(), second, len(second_prompt), 0.5, seed=1)
        got2 = generation(model, tok, session, second_prompt, 3, again)
        assert got2.tokens == second and got2.timings["prompt_cached"] > 0
        subset = mixed.inner.subset
        assert np.array_equal(subset.ids(), with_the_conversation(again.proposals[-1][0]))
        assert subset.added.size > 0  # the conversation has ids above the low ones: they joined

        other = tok.encode("A quiet river ran past the old mill.")
        fresh = Mixed(drafter(), [0] * 64, len(other), 0.0)  # the block's own drafts
        assert (
            generation(model, tok, session, other, 2, fresh).tokens
            == generation(load_model(mf, options=ModelOptions(kv_type="f32")), tok, Session(), other).tokens
        )
        assert np.array_equal(subset.ids(), with_the_conversation(fresh.proposals[-1][0]))
    proposals = mixed.proposals + again.proposals
    assert all(own for _, own in proposals)
    checked = proposals[:: max(1, len(proposals) // 6)] + proposals[-1:]
    for history, own in checked:
        assert own == scratch_drafts(path, history, len(own), with_the_conversation(history)), len(history)
    assert any(own != scratch_drafts(path, history, len(own)) for history, own in checked)  # the subset changed guesses


@pytest.mark.parametrize("qtype", ["Q6_K", "F32"])
def test_the_subset_head_is_the_whole_heads_argmax_over_its_ids(mtp_file, qtype):
    """Each subset row's logit is the whole head's bit for bit, so its guess is the whole
    head's logits' argmax with the other ids left out; ids join once, out-of-range ones
    never; `clear` leaves the low ids."""
    with open_model(mtp_file("qwen35moe", None if qtype == "Q6_K" else qtype)) as mf:
        head = NextN(load_model(mf, options=ModelOptions(kv_type="f32"))).head
        assert head.qtype.name == qtype
        subset = SubsetHead(head, SUBSET)
        rng = np.random.default_rng(0)
        subset.add(rng.integers(0, head.shape[0], 300))
        subset.add([7, head.shape[0] - 1, head.shape[0], -1])
        ids = subset.ids()
        assert ids[-1] == head.shape[0] - 1 and np.array_equal(np.sort(subset.added), ids[SUBSET:])
        for _ in range(16):
            x = rng.standard_normal((1, head.shape[1])).astype(np.float32)
            logits = head(x)[0]
            assert np.array_equal(subset.low(x)[0], logits[:SUBSET]) and np.array_equal(subset.seen(x)[0], logits[subset.added])
            kept = np.full_like(logits, -np.inf)
            kept[ids] = logits[ids]
            assert subset.greedy(NextNStep(x, x)) == int(np.argmax(kept))
        subset.clear()
        assert np.array_equal(subset.ids(), np.arange(SUBSET)) and subset.seen is None


def test_the_subset_heads_ties_go_to_the_lowest_id_and_its_added_rows_are_bounded(monkeypatch):
    """An F32 head whose rows repeat: a tie between a low id and an added one goes to the low
    id, between two added ones to the lower id whatever their order; past SEEN_MOST added rows
    an id is not added."""
    rows = np.zeros((40, 32), np.float32)
    rows[:, 0] = np.arange(40) / 100  # row i's logit on e0 is i / 100
    rows[[3, 30], 0] = 1.0  # a low id and a later one tie
    head = QWeight(quant.QType.F32, rows, rows.shape)
    x = np.eye(1, 32, dtype=np.float32)
    step = NextNStep(x, x)
    subset = SubsetHead(head, 10)
    subset.add([30])
    assert subset.greedy(step) == 3
    rows[[25, 21], 0] = 2.0
    subset = SubsetHead(QWeight(quant.QType.F32, rows, rows.shape), 10)
    subset.add([25])
    subset.add([21, 30])
    assert subset.greedy(step) == 21
    monkeypatch.setattr(SubsetHead, "SEEN_MOST", 4)
    subset.add([11, 12, 13])
    assert np.array_equal(subset.ids()[10:], [11, 21, 25, 30])


def test_draft_vocab_is_checked_and_0_or_the_whole_vocabulary_is_the_whole_head(mtp_file):
    assert load_config(None, {}).compute.draft_vocab == 32768
    for bad, why in ((-1, "out of range"), (1.5, "wrong type"), ("all", "wrong type")):
        with pytest.raises(ConfigError, match=f"^command line: compute.draft_vocab = .*: {why}.*; allowed: an integer >= 0"):
            load_config(None, {"compute.draft_vocab": bad})
    with open_model(mtp_file("qwen35moe")) as mf:
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        for vocab, whole in ((0, True), (mf.spec.n_vocab, True), (1 << 20, True), (1, False), (mf.spec.n_vocab - 1, False)):
            session = Session()
            assert (drafter_for("mtp", model=model, session=session, n_ctx=64, vocab=vocab).subset is None) == whole


@pytest.mark.integration
def test_run_refuses_a_bad_draft_vocab_in_one_line():
    argv = ["run", "tiny", "-p", "hi", "-n", "2", "--draft-vocab", "-5"]
    r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "moe-pipe: error: --draft-vocab: compute.draft_vocab = -5: out of range; allowed: an integer >= 0 and <= 16777216"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35moe", "glm4moe", "bailingmoe3"])
@pytest.mark.parametrize("quant", [None, "F32"])
def test_mtp_greedy_output_is_the_plain_output_at_every_width(mtp_file, arch, quant):
    """Widths 1-4 of the block's own drafts, half swapped for the right ones, quantized and f32."""
    path = mtp_file(arch, quant)
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        plain = generation(model, tok, Session(), prompt).tokens
        for width in (1, 2, 4):
            session = Session()
            mixed = Mixed(drafter_for("mtp", model=model, session=session, n_ctx=512), plain, len(prompt), 0.5, seed=width)
            got = generation(model, tok, session, prompt, width, mixed)
            assert got.tokens == plain and 0 < got.timings["draft_accepted"] < got.timings["draft_n"]


@pytest.mark.parametrize("arch", ["qwen35moe", pytest.param("glm4moe", marks=pytest.mark.slow)])
def test_mtp_sampled_output_is_the_plain_output(mtp_file, arch):
    path = mtp_file(arch, "F32")
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        plain = generation(model, tok, Session(), prompt, temperature=0.9).tokens
        for width, vocab in ((1, 0), (4, 0), (2, SUBSET)):
            session = Session()
            drafter = drafter_for("mtp", model=model, session=session, n_ctx=512, vocab=vocab)
            got = generation(model, tok, session, prompt, width, drafter, 0.9)
            assert got.tokens == plain and got.timings["draft_n"] > 0


def test_a_request_without_drafts_keeps_the_block_fed_and_a_gap_stops_only_the_drafts(mtp_file):
    """A request with --draft 0 between two that draft still hands the block its passes: the
    third drafts, its proposals the block from scratch. A prefix computed before the drafter
    existed is a gap: the request on it drafts nothing (and gives the plain tokens); from
    position 0 it drafts again."""
    path = mtp_file("qwen35moe")
    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        prompt = tok.encode(PROMPT)
        model = load_model(mf, options=ModelOptions(kv_type="f32"))
        session = Session()
        first = generation(model, tok, session, prompt, 2, drafter_for("mtp", model=model, session=session, n_ctx=512))
        more = prompt + first.tokens + tok.encode(" then")
        middle = generation(model, tok, session, more, 0, drafter_for("none", model=model, session=session))
        last_prompt = more + middle.tokens + tok.encode(" so")
        want = generation(load_model(mf, options=ModelOptions(kv_type="f32")), tok, Session(), last_prompt).tokens
        drafter = drafter_for("mtp", model=model, session=session, n_ctx=512)
        recorder = Mixed(drafter, want, len(last_prompt), 0.0)
        got = generation(model, tok, session, last_prompt, 2, recorder)
        assert got.tokens == want and got.timings["prompt_cached"] > len(more)
        assert all(own for _, own in recorder.proposals)  # no gap: the block saw the middle request
        history, own = recorder.proposals[0]
        assert own == scratch_drafts(path, history, len(own))

        fresh_model = load_model(mf, options=ModelOptions(kv_type="f32"))
        late = Session()
        generation(fresh_model, tok, late, more, 0, drafter_for("none", model=fresh_model, session=late))  # no drafter yet
        gapped = generation(fresh_model, tok, late, last_prompt, 2, drafter_for("mtp", model=fresh_model, session=late, n_ctx=512))
        assert gapped.tokens == want and gapped.timings["draft_n"] == 0 and gapped.timings["prompt_cached"] > 0
        late.reset()
        again = generation(fresh_model, tok, late, last_prompt, 2, drafter_for("mtp", model=fresh_model, session=late, n_ctx=512))
        assert again.tokens == want and again.timings["draft_n"] > 0


def test_mtp_on_a_file_without_the_block_is_refused(tmp_path):
    path = make_model("qwen3moe", "tiny", tmp_path / "plain.gguf")
    with open_model(path) as mf:
        model = load_model(mf)
        with pytest.raises(UserError, match="needs a model file with an MTP/NextN block.*use --draft-source ngram"):
            drafter_for("mtp", model=model, session=Session(), n_ctx=256)


@pytest.mark.integration
def test_run_refuses_mtp_drafts_on_a_file_without_the_block_in_one_line(tmp_path):
    path = make_model("qwen3moe", "tiny", tmp_path / "plain.gguf")
    for streamed in ([], ["--no-stream"]):  # before the model loads, both ways
        argv = ["run", str(path), "-p", "hi", "-n", "2", "--draft", "2", "--draft-source", "mtp", *streamed]
        r = subprocess.run([sys.executable, "-m", "moe_pipe.cli.main", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines() == [
            "moe-pipe: error: --draft-source mtp needs a model file with an MTP/NextN block; this qwen3moe file has none "
            "(nextn_predict_layers is 0): use --draft-source ngram"
        ]


def test_run_takes_its_guesses_over_draft_vocab(mtp_file, capsys, monkeypatch):
    """`run --no-stream --draft-vocab N` hands N to the MTP drafter's head, and the tokens are the plain run's."""
    from moe_pipe.cli.main import main

    made, real_init = [], SubsetHead.__init__

    def recording_init(self, head, n_low):
        made.append(n_low)
        real_init(self, head, n_low)

    monkeypatch.setattr(SubsetHead, "__init__", recording_init)
    argv = ["run", str(mtp_file("qwen35moe")), "-p", PROMPT, "-n", "8", "--no-stream", "--output-format", "json", "--ignore-eos"]
    assert main([*argv, "--draft", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*argv, "--draft", "2", "--no-draft-adapt", "--draft-source", "mtp", "--draft-vocab", str(SUBSET)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert made == [SUBSET] and out["tokens"] == plain and out["timings"]["draft_n"] > 0


@pytest.mark.integration
@pytest.mark.parametrize("vocab", [None, SUBSET])
def test_the_pipeline_drafts_from_the_block_with_streamed_experts_and_keeps_the_tokens(mtp_file, vocab):
    """The compute process runs the block beside the least expert cache: the resident reference's
    tokens, every pass with its drafts (no adaptive width), over the whole head (the default
    draft_vocab is above the tiny vocabulary) and over SUBSET ids."""
    from .test_pipeline import _budget_mb, run_pipeline, with_reference

    path, prompt, reference, sizes = with_reference(mtp_file("qwen35moe"), top_ks=(None,))
    tokens, timings, _ = run_pipeline(
        path,
        prompt,
        **{
            "cache.cache_mb": _budget_mb(sizes, "min", None),
            "compute.draft": 2,
            "compute.draft_adapt": False,
            "compute.draft_source": "mtp",
            **({"compute.draft_vocab": vocab} if vocab else {}),
        },
    )
    assert tokens == reference[None]
    assert timings["draft_passes"] > 0 and timings["draft_n"] >= timings["draft_passes"]


@pytest.mark.parametrize("arch,masks", [("qwen35moe", False), ("glm4moe", True), ("bailingmoe3", True)])
def test_the_position_0_pair_takes_its_token_as_the_family_trained(mtp_file, arch, masks):
    """GLM's and Ling's blocks zero the embedding of the pair at position 0 (vLLM's rule for
    their MTP modules), Qwen3.5/3.6's does not: there the first pair's token changes the step."""
    with open_model(mtp_file(arch)) as mf:
        head = NextN(load_model(mf, options=ModelOptions(kv_type="f32")))
        hidden = np.random.default_rng(0).standard_normal((1, mf.spec.n_embd)).astype(np.float32)
        a, b = (head.step(np.array([t]), hidden, head.new_cache(8)).feed for t in (5, 6))
        assert np.array_equal(a, b) == masks
