"""The oracle harness: what every family's tiny models must match, and their checkpoints.

The references (docs/models.md § Checked against the references):
- transformers, on tiny random checkpoints that tests/hfmodels.py builds and
  `moe-pipe convert` converts (f32, and q8_0 where its bound is checked);
- llama.cpp (llama-cpp-python, an optional extra: skipped when absent), on the
  same converted files and on make-model's tiny preset.

`ORACLES` holds one `FamilyOracle` per family of the registry: its checkpoints
(`Config`), its prompts, its bounds and which tier each check runs in.
tests/test_families_oracle.py runs the checks of tests/oracle_checks.py on every
family; a family's own test module keeps only its own checks, and takes the
converted checkpoints from `checkpoint` (each is built once per test session).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moe_pipe.shared.family_registry import Family, by_name
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.text.tokenizer import Tokenizer

from . import hfmodels

N_CTX = 128  # every prompt and its continuation fit
N_GREEDY = 32  # greedy tokens against transformers
N_GREEDY_LLAMA_CPP = 16
N_GREEDY_Q8_0 = 8  # q8_0 greedy: the first 3 of these agree on 2 of 3 prompts
F32_REL = 1e-4  # f32 logits against transformers: max |ours − theirs| / max |theirs|
Q8_0_REL = 0.1  # the first families' q8_0 bound, on the last position

# Prompts as token ids that every test vocabulary holds (a family may feed texts
# through its own tokenizer instead: `Prompts`); MADE_IDS starts with a BOS.
IDS = (tuple(range(3, 40, 3)), (5, 17, 2, 99, 140, 7, 7, 7, 30), tuple(range(11, 32)))
MADE_IDS = ((1, 5, 9, 20, 33, 70, 100, 200, 7, 300, 11),)

ORACLE_REASON = "oracle tests need torch and transformers (pip install '.[oracle]')"
LLAMA_CPP_REASON = "llama-cpp-python not installed (optional extra)"


# -- what each family must match --------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    """What both sides are fed: fixed token ids, or `texts` encoded by the GGUF's own
    tokenizer (cut to `max_len` tokens: CI time)."""

    ids: tuple[tuple[int, ...], ...] = ()
    texts: tuple[str, ...] = ()
    max_len: int | None = None

    def of(self, gguf: Path) -> list[list[int]]:
        if not self.texts:
            return [list(p) for p in self.ids]
        with open_model(gguf) as mf:
            tok = Tokenizer.from_gguf(mf.gguf)
            return [tok.encode(t)[: self.max_len] for t in self.texts]


@dataclass(frozen=True)
class Q8Bound:
    """How far the q8_0 conversion's last-position logits may stray from
    transformers' (relative, as F32_REL), prompt by prompt."""

    rel: float | None = Q8_0_REL  # None: only llama.cpp's own q8_0 error sets the bound
    argmax: bool = False  # the top token stays transformers' on every prompt
    greedy_prefix: bool = False  # greedy output agrees for its first 3 of 8 tokens on 2 of 3 prompts
    # (factor, slack): a prompt past `rel` (every prompt when rel is None: then the
    # worst of each) is no further off than factor × llama.cpp's q8_0 of the file + slack
    llama_cpp: tuple[float, float] | None = None
    slow: bool = True


@dataclass(frozen=True)
class MadeCheck:
    """llama.cpp on make-model's tiny preset written in F32: logits at every position
    of `prompt` within `tol`, the same top tokens, the same tensor bytes, and the same
    N_GREEDY_LLAMA_CPP greedy tokens; then the preset in its own quant mix loaded with
    our shape and bytes."""

    prompt: Prompts = Prompts(MADE_IDS)
    tol: float = 1e-5
    slow: bool = True


@dataclass(frozen=True)
class Config:
    """One tiny checkpoint of a family: `hfmodels.build` keywords and what sets it apart."""

    name: str
    build: Mapping[str, Any] = field(default_factory=dict)
    slow: bool = False  # every check on it runs behind -m slow (CI time)
    # rewrites the saved tensors after transformers has loaded them: the same
    # weights in another layout for the converter to read
    relayout: Callable[[Path], None] | None = None
    no_llama_cpp: str = ""  # why llama.cpp cannot run its converted file (the skip reason)


@dataclass(frozen=True)
class FamilyOracle:
    """What one family's checkpoints are compared on, and in which tier."""

    family: str  # the registry's name, and tests/hfmodels.py's builder
    configs: tuple[Config, ...]
    prompts: Prompts = Prompts(IDS)
    # (tokens, prompts) greedy in the default tier; the rest of N_GREEDY on every prompt is slow
    greedy_default: tuple[int, int] = (N_GREEDY, 3)
    f32_rel: float = F32_REL
    q8_0: Q8Bound = Q8Bound()
    made: MadeCheck = MadeCheck()
    hf_text: bool = False  # the tokenizer's ids and the chat template against transformers'
    # transformers' threads while it runs this family: the lfm2 model's ops are tiny, and two
    # threads on a loaded 2-core machine made its decode ~10x slower (0.3 s a token, 0.03 s on one)
    torch_threads: int | None = None

    @property
    def registry(self) -> Family:
        found = by_name(self.family)
        assert found is not None, self.family
        return found

    def config(self, name: str) -> Config:
        return next(c for c in self.configs if c.name == name)

    @property
    def greedy_left_to_slow(self) -> bool:
        """Whether the default tier leaves some of N_GREEDY tokens on every prompt to the slow one."""
        n, k = self.greedy_default
        return n < N_GREEDY or k < len(self.prompts.ids or self.prompts.texts)

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        if self.torch_threads is None:
            yield
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.torch_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


# deepseek2's v3-yarn checkpoint: YaRN as DeepSeek ships it
DEEPSEEK2_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
# deepseek4's: YaRN for the compressing layers only (transformers' `compress` rope; llama.cpp
# applies the file's scaling to them alone), over a short original context so the prompts reach it
DEEPSEEK4_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
# The first families: q8_0 and the text checks in the default tier.
FIRST_Q8_0 = Q8Bound(greedy_prefix=True, slow=False)

ORACLES: dict[str, FamilyOracle] = {
    o.family: o
    for o in (
        FamilyOracle("qwen3moe", (Config("default"),), q8_0=FIRST_Q8_0, made=MadeCheck(slow=False), hf_text=True),
        FamilyOracle("gpt_oss", (Config("default"),), q8_0=FIRST_Q8_0, made=MadeCheck(slow=False), hf_text=True),
        # ggml's GELU uses an f16 lookup table: llama.cpp is ~1e-3 off
        FamilyOracle("gemma4", (Config("default"),), q8_0=FIRST_Q8_0, made=MadeCheck(tol=5e-3, slow=False), hf_text=True),
        FamilyOracle(
            "qwen35moe",
            (Config("text"), Config("multimodal", dict(multimodal=True), slow=True)),
            # The random delta-rule layers amplify rounding: q8_0 weights move this tiny
            # model's logits by tens of percent, in llama.cpp as much, so no fixed bound holds.
            q8_0=Q8Bound(rel=None, llama_cpp=(1.5, 0.02), slow=False),
            made=MadeCheck(Prompts(IDS[1:2]), slow=False),
        ),
        FamilyOracle(
            "mixtral",
            (
                Config("x4k2", dict(experts=4, used=2)),  # GQA, 2 of 4
                Config("x8k4-per-expert", dict(experts=8, used=4, per_expert=True), slow=True),  # the published layout
                Config("x4k2-byte-level", dict(experts=4, used=2, byte_level=True), slow=True),  # a Llama-3-style tokenizer
            ),
            prompts=Prompts(texts=hfmodels.SAMPLES, max_len=12),  # short: CI time
            q8_0=Q8Bound(argmax=True),
            made=MadeCheck(Prompts(texts=hfmodels.SAMPLES[:1])),
        ),
        FamilyOracle(
            "glm4moe",
            (
                # 1 dense layer, 4 groups of 4 experts (best 2 kept), q/k/v biases, no qk-norm, scale 1.5
                Config("air"),
                # no dense layer, qk-norm on, no biases, no groups, weights not renormalized
                Config(
                    "qknorm-nogroups",
                    dict(use_qk_norm=True, first_k_dense_replace=0, n_group=1, topk_group=1, attention_bias=False, norm_topk_prob=False),
                    slow=True,
                ),
                # 2 dense layers of 4, one group kept of 2, qk-norm and biases both on
                Config(
                    "deep-dense",
                    dict(
                        num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1, use_qk_norm=True, routed_scaling_factor=1.0
                    ),
                    slow=True,
                ),
            ),
            greedy_default=(8, 1),
            q8_0=Q8Bound(greedy_prefix=True),
            made=MadeCheck(Prompts(IDS[1:2])),
        ),
        FamilyOracle(
            "lfm2moe",
            (
                # a dense layer 0, conv and attention alternating, the expert bias
                Config("bias"),
                # no expert bias, attention first, two dense layers
                Config(
                    "nobias-dense2",
                    dict(
                        use_expert_bias=False, num_dense_layers=2, layer_types=["full_attention", "conv", "conv", "full_attention", "conv"]
                    ),
                    slow=True,
                ),
                # transformers saves the experts one by one as the published checkpoint does;
                # the converter reads its fused in-memory form too
                Config("fused", slow=True, relayout=hfmodels.fuse_lfm2moe_experts),
            ),
            prompts=Prompts(tuple((1, *p) for p in IDS)),  # after its BOS
            greedy_default=(N_GREEDY, 1),
            # where rounding flips a near-tied expert choice (nobias-dense2's third prompt:
            # 0.28, in llama.cpp as much), no further off than llama.cpp's q8_0 of the file
            q8_0=Q8Bound(llama_cpp=(1.1, 0.0)),
            made=MadeCheck(Prompts(texts=("The history of the city begins",))),
            torch_threads=1,
        ),
        FamilyOracle(
            "deepseek2",
            (
                # V3: q_lora > 0, 1 leading dense layer, sigmoid + bias, 4 groups (best 2), a shared expert, scale 1.5
                Config("v3", dict(v3=True)),
                # V2-Lite's form: q_lora 0 (plain attn_q), no dense layer, softmax greedy, no renormalization, 2 shared experts
                Config(
                    "v2",
                    dict(v3=False, n_shared_experts=2),
                    slow=True,
                    # llama.cpp 0.3.36 takes a file without q_lora_rank for V2-Lite only by its 27
                    # layers: tests/test_deepseek2.py checks that form at 27 layers
                    no_llama_cpp="q_lora_rank 0 at 3 layers: see test_llama_cpp_runs_v2_lite_form",
                ),
                # V2's group_limited_greedy: softmax, a group scores its best expert (V3's rule, the
                # sum of the best two, picks other groups here: tests/test_deepseek2.py)
                Config(
                    "v2-groups",
                    dict(v3=False, topk_method="group_limited_greedy", n_group=2, topk_group=1),
                    slow=True,
                    no_llama_cpp="llama.cpp scores an expert group by its top-2 sum, V2 by its best expert",
                ),
                # V3 with 2 leading dense layers, no shared expert, no renormalization, no groups
                Config(
                    "v3-dense2",
                    dict(v3=True, first_k_dense_replace=2, n_shared_experts=0, norm_topk_prob=False, n_group=1, topk_group=1),
                    slow=True,
                    no_llama_cpp="llama.cpp 0.3.36 refuses a deepseek2 file without shared-expert tensors (expert_shared_count 0)",
                ),
                # YaRN with mscale = mscale_all_dim: the score's mscale² and the ramped frequencies
                Config("v3-yarn", dict(v3=True, max_position_embeddings=256, rope_parameters=DEEPSEEK2_YARN), slow=True),
            ),
            greedy_default=(8, 1),  # transformers' generate is the slow part
            q8_0=Q8Bound(greedy_prefix=True),
            made=MadeCheck(Prompts(IDS[1:2]), tol=1e-4),
        ),
        FamilyOracle(
            "deepseek4",
            (
                # sliding, CSA, HCA, CSA; HCA by 8 so that the prompts reach it
                Config("hca8", no_llama_cpp="llama.cpp's deepseek4 compresses HCA layers by 128 only: the hca128 config runs there"),
                # HCA by 128, as DeepSeek-V4 has it (the prompts stay short of a whole window)
                Config("hca128", dict(hca_rate=128), slow=True),
                # YaRN on the compressing layers (unit-sized), as DeepSeek-V4 ships it
                Config("hca128-yarn", dict(hca_rate=128, max_position_embeddings=64, rope_parameters=DEEPSEEK4_YARN), slow=True),
            ),
            # the third prompt (21 tokens) passes the window (8), the indexer's top k (3 entries of 4)
            # and HCA's 8; the greedy continuations pass them on every prompt
            greedy_default=(8, 1),  # transformers' generate is the slow part
            # the indexer's top k is a discrete choice: on the 21-token prompt (3 of 5 entries kept)
            # q8_0 rounding flips a close pick and the logits move by 0.15-0.2
            q8_0=Q8Bound(rel=0.25, greedy_prefix=True),
        ),
        FamilyOracle(
            "qwen2moe",
            (
                Config("plain"),  # Qwen1.5-MoE's routing (no renormalization), biases, GQA, per-expert checkpoint
                # Qwen2-style renormalized top-k; transformers 5's fused experts
                Config(
                    "norm-fused",
                    dict(norm_topk_prob=True, fused=True),
                    slow=True,
                    no_llama_cpp="llama.cpp ignores expert_weights_norm for qwen2moe (docs/models.md § qwen2moe)",
                ),
                # zero biases written; MHA as Qwen1.5
                Config("nobias-mha", dict(qkv_bias=False, num_key_value_heads=4, num_experts_per_tok=4), slow=True),
            ),
            prompts=Prompts(texts=hfmodels.SAMPLES),
            greedy_default=(8, 1),
            q8_0=Q8Bound(argmax=True),
            made=MadeCheck(Prompts(texts=hfmodels.SAMPLES[:1])),
        ),
        FamilyOracle(
            "bailingmoe3",
            (
                # KDA, MLA, KDA, MLA; layer 0 dense; 4 groups (best 2); a shared expert; no q_lora
                Config("default"),
                # MLA on every third layer of 6 with q_lora, 2 dense layers, no groups, weights not renormalized
                Config(
                    "qlora-dense2",
                    dict(
                        num_hidden_layers=6,
                        layer_group_size=3,
                        q_lora_rank=48,
                        first_k_dense_replace=2,
                        n_group=1,
                        topk_group=1,
                        norm_topk_prob=False,
                    ),
                    slow=True,
                ),
            ),
            greedy_default=(8, 1),  # transformers' generate is the slow part
            q8_0=Q8Bound(rel=None, llama_cpp=(1.5, 0.02)),
            made=MadeCheck(Prompts(IDS[1:2]), tol=1e-4),
        ),
    )
}


def config_params(family: str) -> list:
    """The family's configs as pytest parameters, the slow ones marked."""
    return [pytest.param(c.name, marks=[pytest.mark.slow] if c.slow else []) for c in ORACLES[family].configs]


def cases(
    where: Callable[[FamilyOracle, Config], bool] = lambda o, c: True, slow: Callable[[FamilyOracle], bool] = lambda o: False
) -> list:
    """(family, config) of every family as pytest parameters, marked slow where the
    config or the check (`slow`) is."""
    return [
        pytest.param(o.family, c.name, id=f"{o.family}-{c.name}", marks=[pytest.mark.slow] if c.slow or slow(o) else [])
        for o in ORACLES.values()
        for c in o.configs
        if where(o, c)
    ]


def families(slow: Callable[[FamilyOracle], bool] = lambda o: False) -> list:
    """Every family as a pytest parameter, marked slow where the check (`slow`) is."""
    return [pytest.param(o.family, id=o.family, marks=[pytest.mark.slow] if slow(o) else []) for o in ORACLES.values()]


# -- the checkpoints ------------------------------------------------------------


def require_transformers() -> None:
    pytest.importorskip("torch", reason=ORACLE_REASON)
    pytest.importorskip("transformers", reason=ORACLE_REASON)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A family's tiny checkpoint, saved and loaded in transformers; converted on
    first use of each type."""

    oracle: FamilyOracle
    config: Config
    hf_dir: Path
    ref: Any  # the transformers model, eval mode, float32
    _ggufs: dict[str, Path] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return f"{self.oracle.family}-{self.config.name}"

    def gguf(self, outtype: str = "f32") -> Path:
        from moe_pipe.shared.convert.converter import convert

        if outtype not in self._ggufs:
            self._ggufs[outtype] = convert(self.hf_dir, self.hf_dir.parent / f"m-{outtype}.gguf", outtype=outtype)
        return self._ggufs[outtype]

    @cached_property
    def prompts(self) -> list[list[int]]:
        return self.oracle.prompts.of(self.gguf())

    def hf_logits(self, ids: list[int]) -> np.ndarray:
        with self.oracle.threads():
            return hfmodels.hf_logits(self.ref, ids)

    def hf_greedy(self, ids: list[int], n: int) -> list[int]:
        with self.oracle.threads():
            return hfmodels.hf_greedy(self.ref, ids, n)


_BUILT: dict[tuple[str, str], Checkpoint] = {}


def checkpoint(family: str, config: str, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The family's checkpoint `config`, built once per session (its folder is the session's)."""
    if (family, config) not in _BUILT:
        require_transformers()
        oracle, cfg = ORACLES[family], ORACLES[family].config(config)
        root = tmp_path_factory.mktemp(f"{family}-{config}")
        with oracle.threads():
            hf_dir = hfmodels.build(family, root / "hf", **cfg.build)
            ref = hfmodels.load_model(hf_dir)
        if cfg.relayout:
            cfg.relayout(hf_dir)
        _BUILT[family, config] = Checkpoint(oracle, cfg, hf_dir, ref)
    return _BUILT[family, config]


def checkpoints(family: str, name: str = "ck"):
    """A module fixture `name`: the family's checkpoints, one per config (the slow ones marked)."""

    @pytest.fixture(scope="module", params=config_params(family), name=name)
    def fixture(request, tmp_path_factory) -> Checkpoint:
        return checkpoint(family, request.param, tmp_path_factory)

    return fixture
