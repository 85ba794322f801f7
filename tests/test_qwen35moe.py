"""qwen35moe (Qwen3.5/3.6 MoE): the hybrid of gated full attention and
gated-delta-rule linear attention, with a shared expert.

Its checkpoints (text-only and the published multimodal layout) are held to
transformers and llama.cpp with every family's checks in
tests/test_families_oracle.py (its entry in tests/oracle.py; the q8_0 one to
llama.cpp's own q8_0 error). Here: the converted layer pattern, the recurrent
state (cache semantics, batching, budget), what is refused, the shape preset,
the qwen35 split; the streaming pipeline is in tests/test_family_pipelines.py
(docs/models.md § qwen35moe).
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_pipe.shared.errors import UserError
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.gguf.spec import kv_cache_bytes, recurrent_state_bytes
from moe_pipe.shared.makemodel.maker import make_model
from moe_pipe.shared.model.load import load_model

from . import oracle
from .realheaders import assert_published, made_header

PROMPTS = [list(p) for p in oracle.IDS]

ck = oracle.checkpoints("qwen35moe")


@pytest.mark.oracle
def test_converted_layers_alternate_linear_and_full_attention(ck):
    with open_model(ck.gguf()) as mf:
        assert mf.spec.recurrent_layers == (True, False, True, False)


# -- the recurrent state -------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model("qwen35moe", "tiny", tmp_path_factory.mktemp("q35") / "tiny.gguf")


def test_batches_and_decode_steps_equal_one_prefill(made):
    """The conv and delta-rule state carry across prompt batches and decode steps:
    logits of one 9-token batch = batches of 4 = 1 + decode steps."""
    ids = PROMPTS[1]
    with open_model(made) as mf:
        model = load_model(mf)
        whole = model.forward(ids, model.new_cache(32), all_logits=True)
        cache = model.new_cache(32)
        batched = model.prefill(ids, cache, batch=4)
        cache = model.new_cache(32)
        steps = [model.decode_one(t, cache) for t in ids]
    np.testing.assert_allclose(batched, whole[-1], rtol=0, atol=1e-4 * np.abs(whole).max())
    np.testing.assert_allclose(np.stack(steps), whole, rtol=0, atol=1e-4 * np.abs(whole).max())


def test_cache_truncates_only_to_zero_and_zero_resets_the_state(made):
    ids = PROMPTS[1]
    with open_model(made) as mf:
        model = load_model(mf)
        cache = model.new_cache(32)
        first = model.forward(ids, cache)
        assert cache.state is not None and cache.can_truncate(0) and cache.can_truncate(len(ids))
        assert not cache.can_truncate(4)
        with pytest.raises(ValueError, match="cannot be rewound"):
            cache.truncate(4)
        assert cache.n == len(ids)  # a refused truncate changes nothing
        cache.truncate(0)
        assert cache.n == 0 and all(not a.any() for a in (*cache.state.conv.values(), *cache.state.delta.values()))
        np.testing.assert_array_equal(model.forward(ids, cache), first)


def test_conversations_reuse_a_whole_cache_or_none_and_sessions_are_refused(made, tmp_path):
    """Prefix reuse on a hybrid model: a prompt that extends everything the cache
    holds continues from it; one that leaves it part way recomputes from 0 (the
    state cannot be rewound); a context shift recomputes the kept head; saving
    is refused in one line (the file format has no place for the state). Each
    gives the tokens of a fresh run (one position per pass, so only leaked
    state could differ)."""
    from moe_pipe.shared.model.session import Session, save_session
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    def run(model, tok, prompt, n, session=None, n_ctx=64, **kw):
        cfg = GenerationConfig(max_tokens=n, n_ctx=n_ctx, ignore_eos=True, prefill_batch=1, **kw)
        return generate(model, tok, prompt, SamplingParams(), cfg, session=session)

    with open_model(made) as mf:
        model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
        first = PROMPTS[1]
        session = Session()
        turn1 = run(model, tok, first, 6, session)
        extended = first + turn1.tokens + PROMPTS[2]
        turn2 = run(model, tok, extended, 6, session)
        assert turn2.timings["prompt_cached"] == len(first) + len(turn1.tokens) - 1  # the last output token never ran
        assert turn2.tokens == run(model, tok, extended, 6).tokens
        diverged = first[:3] + PROMPTS[2]
        turn3 = run(model, tok, diverged, 6, session)
        assert turn3.timings["prompt_cached"] == 0
        assert turn3.tokens == run(model, tok, diverged, 6).tokens
        long = run(model, tok, first, 80, Session(), n_ctx=32, context_shift=True, n_keep=2)
        assert len(long.tokens) == 80 and long.timings["context_shifts"] >= 1
        with pytest.raises(UserError) as e:
            save_session(tmp_path / "s.bin", session, ("x",), arch="qwen35moe")
        assert "\n" not in str(e.value) and "qwen35moe" in str(e.value)
        assert not list(tmp_path.iterdir())


def test_another_session_gives_its_prefix_only_when_its_state_holds_exactly_that(made):
    """Prefixes shared across slots (Session.share_from, procs/slots.py) on a hybrid model: a
    session that holds exactly a prompt's prefix gives it (state and KV copied) and the prompt
    continues from it with a fresh run's tokens; one that has gone on past it has nothing to
    give, as its state cannot be rewound (docs/batching.md § Prompt prefixes shared across slots)."""
    from moe_pipe.shared.model.session import Session
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    def run(model, tok, prompt, n, session=None):
        cfg = GenerationConfig(max_tokens=n, n_ctx=64, ignore_eos=True, prefill_batch=1)
        return generate(model, tok, prompt, SamplingParams(), cfg, session=session)

    with open_model(made) as mf:
        model, tok = load_model(mf), Tokenizer.from_gguf(mf.gguf)
        prefix, donor, mine = PROMPTS[1], Session(), Session()
        run(model, tok, prefix, 1, donor)  # holds the prefix exactly (its one output token never ran)
        prompt = prefix + PROMPTS[2]
        assert donor.reusable(prompt) == len(prefix) == donor.n
        mine.share_from(donor, len(prefix), model, 64)
        got = run(model, tok, prompt, 6, mine)
        assert got.timings["prompt_cached"] == len(prefix) and got.tokens == run(model, tok, prompt, 6).tokens
        run(model, tok, prefix, 3, donor)  # now it holds the prefix and two output tokens
        assert donor.n > len(prefix) and donor.reusable(prompt) == 0
        with pytest.raises(ValueError, match="only shared whole"):
            Session().share_from(donor, len(prefix), model, 64)


def test_budget_counts_the_state_and_kv_of_attention_layers_only(made):
    with open_model(made) as mf:
        s = mf.spec
        model = load_model(mf)
        cache = model.new_cache(100, "f32")
        attn = [i for i in range(s.n_layer) if not s.is_recurrent(i)]
        kv = 100 * sum(s.n_head_kv[i] * (s.head_dim_k[i] + s.head_dim_v[i]) for i in attn) * 4
        # tiny: 2 linear layers, conv 3 × (2·2 + 4)·64 inputs and a 4 × 64 × 64 delta state each, float32
        assert recurrent_state_bytes(s) == 2 * 4 * (3 * 512 + 4 * 64 * 64) == cache.state.nbytes
        assert kv_cache_bytes(s, 100, "f32") == kv + cache.state.nbytes
        assert kv == sum(a.nbytes for a in cache.parts())


def test_only_routed_experts_stream_the_shared_expert_is_dense(made):
    with open_model(made) as mf:
        names = mf.layout.expert_tensor_names
        assert all(".ffn_" in n and n.endswith("_exps.weight") for n in names)
        assert len(names) == 3 * mf.spec.n_layer
        assert not any("shexp" in n for n in names)
        assert mf.gguf.tensors["blk.0.ffn_down_shexp.weight"].name not in names


def test_delta_rule_l2_norm_adds_eps_under_the_root():
    """q and k as transformers' l2norm and llama.cpp's qwen35moe graph normalize them:
    x / √(Σx² + eps), not ggml_l2_norm's x / max(‖x‖, eps) (1e-4 apart on rows this short)."""
    from moe_pipe.shared.families.qwen35moe.model import l2_normalize

    x = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32) * np.float32(0.02)
    sq = np.sum(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    np.testing.assert_allclose(l2_normalize(x, 1e-6), x / np.sqrt(sq + 1e-6), rtol=1e-6)
    assert np.abs(l2_normalize(x, 1e-6) - x / np.sqrt(sq)).max() > 1e-5


@pytest.fixture(scope="module")
def made_pair(tmp_path_factory):
    """The tiny model without and with the MTP block, as llama.cpp's converter writes it."""
    d = tmp_path_factory.mktemp("q35mtp")
    return make_model("qwen35moe", "tiny", d / "plain.gguf"), make_model("qwen35moe", "tiny", d / "mtp.gguf", mtp=True)


def test_the_mtp_block_is_counted_checked_and_laid_aside(made_pair):
    """block_count 5 = 4 decoder layers + the MTP block (a full-attention MoE layer with
    nextn.eh_proj/enorm/hnorm/shared_head_norm); the decoder's tensors are the plain file's
    bytes; the block is neither an expert nor in the dense set."""
    from moe_pipe.shared.analysis import fit

    plain, mtp = made_pair
    with open_model(plain) as a, open_model(mtp) as b:
        assert b.gguf.meta("qwen35moe.block_count") == 5 and b.gguf.meta("qwen35moe.nextn_predict_layers") == 1
        assert (b.spec.n_layer, b.spec.n_layer_nextn, b.spec.recurrent_layers) == (4, 1, (True, False, True, False))
        block = {n for n in b.gguf.tensors if n.startswith("blk.4.")}
        assert block == b.layout.nextn_tensor_names
        assert {"blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.ffn_gate_exps.weight"} <= block
        assert b.gguf.tensors["blk.4.nextn.eh_proj.weight"].shape == (256, 512)
        assert set(a.gguf.tensors) == set(b.gguf.tensors) - block
        for n in a.gguf.tensors:
            assert np.array_equal(np.asarray(a.gguf.view(n)), np.asarray(b.gguf.view(n))), n
        assert b.layout.nextn_bytes == sum(b.gguf.tensors[n].nbytes for n in block) > 0
        assert (b.layout.dense_bytes, b.layout.total_expert_bytes) == (a.layout.dense_bytes, a.layout.total_expert_bytes)
        assert b.layout.expert_tensor_names.isdisjoint(block)
        nextn = [b.gguf.tensors[n] for n in block]
        assert not any(d.offset < t.end and t.offset < d.end for t in nextn for d in b.layout.dense)
        # what a token costs (doctor's forecast) and the types inspect lists are the plain file's
        assert fit.kernel_classes(b, 2) == fit.kernel_classes(a, 2) and b.quant_types() == a.quant_types()


def test_the_mtp_block_is_never_read_and_changes_no_token(made_pair, monkeypatch):
    """Greedy tokens with the block are the plain file's (ours, and llama.cpp's: llama-cpp-python
    loads the file; its Q8 activations make its tokens its own); every tensor the model reads
    goes through GGUFFile.view, and none of the block's does."""
    from moe_pipe.shared.gguf.reader import GGUFFile

    from .oracle_checks import llama, llama_greedy, ours_greedy

    plain, mtp = made_pair
    with open_model(plain) as mf:
        want = ours_greedy(load_model(mf), PROMPTS[1], 8)
    viewed: list[str] = []
    real_view = GGUFFile.view
    monkeypatch.setattr(GGUFFile, "view", lambda self, name: viewed.append(name) or real_view(self, name))
    with open_model(mtp) as mf:
        got = ours_greedy(load_model(mf), PROMPTS[1], 8)
        block = mf.layout.nextn_tensor_names
    assert got == want
    assert "blk.3.ffn_gate_exps.weight" in viewed and "blk.0.attn_qkv.weight" in viewed  # the count sees the reads
    assert block and block.isdisjoint(viewed)
    assert llama_greedy(llama(mtp), PROMPTS[1], 8) == llama_greedy(llama(plain), PROMPTS[1], 8)


def test_a_block_count_without_its_block_is_refused(made_pair, tmp_path):
    """nextn_predict_layers naming 2 blocks where block 3 is a decoder layer: it lacks
    nextn.eh_proj; out of range (as many as block_count): refused by key."""
    from gguf import GGUFValueType

    from moe_pipe.shared.errors import GGUFError

    from .ggufgen import with_metadata

    _, mtp = made_pair
    two = with_metadata(mtp, tmp_path / "two.gguf", {"qwen35moe.nextn_predict_layers": (2, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.3\.nextn\.eh_proj\.weight'"):
        open_model(two)
    bad = with_metadata(mtp, tmp_path / "bad.gguf", {"qwen35moe.nextn_predict_layers": (5, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="nextn_predict_layers"):
        open_model(bad)


def test_inspect_says_the_mtp_block_is_there_and_not_loaded(made_pair, capsys):
    from moe_pipe.cli.inspect_cmd import print_table, summary

    plain, mtp = made_pair
    with open_model(plain) as mf:
        assert summary(mf)["nextn_layers"] == 0
    with open_model(mtp) as mf:
        s = summary(mf)
        nbytes = mf.layout.nextn_bytes
    assert (s["nextn_layers"], s["nextn_bytes"]) == (1, nbytes)
    print_table(s)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("MTP/NextN block"))
    assert f"({nbytes:,} B)" in row and "not loaded" in row


def test_shape_preset_has_the_real_per_expert_bytes_and_state(tmp_path):
    """qwen35-35b-shape at full depth (sparse: the header and table are exact, the
    data a hole): Qwen3.5-35B-A3B's widths, its Q4_K_M expert bytes, 30 recurrent layers."""
    path = make_model("qwen35moe", "qwen35-35b-shape", tmp_path / "s.gguf", sparse=True)
    with open_model(path) as mf:
        s, lay = mf.spec, mf.layout
        assert (s.n_layer, s.n_embd, s.n_expert, s.n_expert_used, s.n_ff_exp, s.n_ff_shexp) == (40, 2048, 256, 8, 512, 512)
        assert sum(s.recurrent_layers) == 30 and s.rope.dim == 64 and s.head_dim_k[3] == 256
        q4k, q6k = 512 * 2048 // 256 * 144, 512 * 2048 // 256 * 210  # one [512, 2048] matrix
        # gate and up Q4_K; down Q6_K on llama.cpp's "more bits" layers, else Q4_K
        assert {lay.expert_bytes(i) for i in range(40)} == {3 * q4k, 2 * q4k + q6k}
        assert lay.expert_tensor_names.isdisjoint(n for n in mf.gguf.tensors if "shexp" in n)
        per_layer = 4 * (3 * (2 * 16 + 32) * 128 + 32 * 128 * 128)  # conv inputs + delta state, float32
        assert recurrent_state_bytes(s) == 30 * per_layer
        assert kv_cache_bytes(s, 1000, "f16") == 1000 * 10 * 2 * (256 + 256) * 2 + 30 * per_layer


def test_made_model_chat_template_opens_the_think_block(made):
    from moe_pipe.shared.text.chat import render_chat

    with open_model(made) as mf:
        text = render_chat(mf.gguf, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


# Combining marks (\p{M}) split words under qwen2's regex and stay inside them under qwen35's.
_MARKED = ["cafe\u0301 au lait", "नमस्ते दुनिया", "Ελληνικά ά́", "x\u0308y\u0308 don't 12345"]


@pytest.mark.oracle
def test_qwen35_split_keeps_combining_marks_in_words_as_llama_cpp_does(made, tmp_path):
    """Real Qwen3.5 GGUFs carry tokenizer.ggml.pre "qwen35": our split of it gives llama.cpp's ids."""
    llama_cpp = pytest.importorskip("llama_cpp", reason=oracle.LLAMA_CPP_REASON)
    from gguf import GGUFValueType

    from moe_pipe.shared.gguf.reader import GGUFFile
    from moe_pipe.shared.text.tokenizer import Tokenizer

    from .ggufgen import with_metadata

    path = with_metadata(made, tmp_path / "qwen35.gguf", {"tokenizer.ggml.pre": ("qwen35", GGUFValueType.STRING)})
    with GGUFFile(path) as f:
        ours = Tokenizer.from_gguf(f)
    assert ours.pre == "qwen35"
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in _MARKED:
            assert ours.encode(text, add_bos=False) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    finally:
        llm.close()
    # The samples split differently under the two regexes (the made vocab was trained on qwen2's
    # split, so its ids mostly agree either way: the pieces are what tells the regexes apart).
    from tokenizers import Regex, pre_tokenizers

    from moe_pipe.shared.text.tokenizer import QWEN2_REGEX, QWEN35_REGEX

    def pieces(regex, text):
        return [p for p, _ in pre_tokenizers.Split(Regex(regex), behavior="isolated").pre_tokenize_str(text)]

    assert pieces(QWEN35_REGEX, "नमस्ते दुनिया") == ["नमस्ते", " दुनिया"] != pieces(QWEN2_REGEX, "नमस्ते दुनिया")


# What public load logs of real Qwen3.5/3.6-35B-A3B GGUFs with their MTP block print of the
# header (kv 23-33 in ggml-org/llama.cpp issue #25121, kv 17-20 in ggml-org/llama.cpp pull
# request #22673, kv 24-29 in am17an/llama.cpp pull request #6; Qwen3.5-397B's log in
# ikawrakow/ik_llama.cpp issue #1695 has the same `qwen35` pre-split).
REAL_35B_HEADER = {
    "qwen35moe.context_length": 262144,
    "qwen35moe.embedding_length": 2048,
    "qwen35moe.attention.head_count": 16,
    "qwen35moe.attention.head_count_kv": 2,
    "qwen35moe.expert_count": 256,
    "qwen35moe.expert_used_count": 8,
    "qwen35moe.attention.key_length": 256,
    "qwen35moe.attention.value_length": 256,
    "qwen35moe.expert_feed_forward_length": 512,
    "qwen35moe.expert_shared_feed_forward_length": 512,
    "qwen35moe.ssm.conv_kernel": 4,
    "qwen35moe.ssm.state_size": 128,
    "qwen35moe.ssm.group_count": 16,
    "qwen35moe.ssm.time_step_rank": 32,
    "qwen35moe.ssm.inner_size": 4096,
    "qwen35moe.full_attention_interval": 4,
    "qwen35moe.rope.dimension_count": 64,
    "qwen35moe.nextn_predict_layers": 1,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen35",
}
REAL_35B_VOCAB = 248320


def test_the_35b_shape_s_header_has_a_real_file_s_values(tmp_path):
    with made_header("qwen35moe", "qwen35-35b-shape", tmp_path, mtp=True) as f:
        assert_published(f, REAL_35B_HEADER)
        assert f.meta_len("tokenizer.ggml.tokens") == REAL_35B_VOCAB
