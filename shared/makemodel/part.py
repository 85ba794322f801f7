"""What make-model asks of a family: the `PlanPart` every family's
`shared/families/<family>/plan.py` provides, and the `TensorSpec` its layer
plan lists.

A plan part exports `PLAN`, an instance of a class that subclasses `PlanPart`:
the members without a body (presets, router, layer, vocab) are the family's to
give; the others are hooks whose defaults are what most families write, so a
family overrides only where llama.cpp writes it differently. maker.py plans
the file and writes its metadata from these members alone.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from gguf import GGMLQuantizationType as Q

from ..gguf.vocab import Vocab
from ..quant.blocks import block_format
from .presets import Preset, RouterShape, q4_k_m

if TYPE_CHECKING:
    from gguf import GGUFWriter


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write. `shape` is numpy order (last axis = ggml ne0)."""

    name: str
    shape: tuple[int, ...]
    qtype: Q
    fill: str  # weight | norm | norm_scaled | ones | router | router_bias | bias | bias_scaled | sinks | scale | nvfp4_scale | rope_freqs | conv | ssm_a | expert_ids
    param: float = 0.0  # std of the random values; rope_freqs: fraction of pairs that rotate

    @property
    def byte_shape(self) -> tuple[int, ...]:
        if self.qtype == Q.I32:  # an index table (deepseek4's token → experts), not a weight
            return (*self.shape[:-1], 4 * self.shape[-1])
        return (*self.shape[:-1], block_format(self.qtype).row_bytes(self.shape[-1]))

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape) if self.qtype == Q.I32 else block_format(self.qtype).tensor_bytes(self.shape)


# The two constructors a layer plan builds its tensors with (maker.plan_tensors passes them in):
# W(name, shape, role, layer=0): a weight matrix typed by the family's quant mix (PlanPart.mix);
# F(name, shape, fill): an F32 vector or router filled as `fill` says (TensorSpec.fill).
MakeWeight = Callable[..., TensorSpec]
MakeVector = Callable[[str, tuple[int, ...], str], TensorSpec]

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside the family's plan.py


def stacked_experts(W: MakeWeight, b: str, p: Preset, i: int) -> list[TensorSpec]:
    """Layer i's routed experts as llama.cpp stacks them, one tensor per projection
    (gate, up, down), for a layer with tensor prefix `b`."""
    D, X, Fe = p.n_embd, p.n_expert, p.n_ff_exp
    return [
        W(b + "ffn_gate_exps.weight", (X, Fe, D), "ffn_gate_exps", i),  # X F D
        W(b + "ffn_up_exps.weight", (X, Fe, D), "ffn_up_exps", i),  # X F D
        W(b + "ffn_down_exps.weight", (X, D, Fe), "ffn_down_exps", i),  # X D F
    ]


class PlanPart(Protocol):
    """A family's make-model plan: its presets, tensors, metadata, vocabulary and template."""

    presets: Mapping[str, Preset]
    """The family's presets by name: tiny and small (presets.SHARED_PRESETS) and the
    real model's shape, in the order the CLI and docs list them."""

    router: RouterShape
    """How its routers are filled (maker.py "routers"; presets.RouterShape)."""

    mix_name: ClassVar[str] = "Q4_K_M"
    """The real files' quant mix, as general.description and general.file_type name it."""

    final_norm: ClassVar[str] = "output_norm.weight"
    """The final norm's tensor name."""

    tied_head: ClassVar[bool] = False
    """The output head is token_embd (no output.weight), which then takes the mix's output rule."""

    router_input_norm: ClassVar[str | None] = None
    """The per-layer norm the router reads (e.g. "ffn_norm.weight"): flat where a shape
    preset shapes the residual stream (maker.py "Cross-layer predictability");
    None: the family's stream is never shaped."""

    first_query: ClassVar[tuple[str, ...]] = ()
    """Layer 0's tensors that carry its query scale under stream shaping
    (RouterShape.first_attn_q): a norm is filled at that scale, a weight or bias scaled by it."""

    width_keys: ClassVar[tuple[str, ...]] = ("feed_forward_length", "expert_feed_forward_length")
    """The FFN width keys llama.cpp's converter writes for the family: its HF config's
    intermediate_size and moe_intermediate_size, where the config has them."""

    head_dim_in_config: ClassVar[bool] = True
    """The family's HF configs carry head_dim, from which llama.cpp's converter writes
    attention.key_length / value_length; False: written only where the head width is not
    n_embd / n_head (a config then has to say it)."""

    nextn_key_always: ClassVar[bool] = False
    """`nextn_predict_layers` is written without a NextN/MTP block too (as 0), as llama.cpp's converter does."""

    add_space_prefix: ClassVar[bool | None] = None
    """tokenizer.ggml.add_space_prefix, written when not None."""

    def layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """Layer i's tensors in llama.cpp's file order, built with W and F."""
        ...

    def vocab(self, size: int, n_bpe: int) -> Vocab:
        """The made model's vocabulary: exactly `size` tokens, at most `n_bpe` of them trained."""
        ...

    def nextn_layer(self, p: Preset, i: int, W: MakeWeight, F: MakeVector) -> list[TensorSpec]:
        """Block i (= the decoder's depth: it follows the decoder's layers) as llama.cpp's
        converter writes the family's NextN/MTP layer (shared/gguf/nextn.py); [] where that
        converter writes none, so make-model --mtp refuses the family."""
        return []

    def head_tensors(self, p: Preset) -> list[TensorSpec]:
        """The family's own tensors outside the layers, written between token_embd and the final norm."""
        return []

    def mix(self, role: str, layer: int, n_layer: int, v_index: int, n_v: int) -> Q:
        """The real file's type for weight matrix `role` before the row-width fallback
        (presets.q4_k_m says what the arguments are)."""
        return q4_k_m(role, layer, n_layer, v_index, n_v, tied_head=self.tied_head)

    def router_std(self, logit_std: float, ne0: int) -> float:
        """The router weights' std for logits of spread `logit_std`: the router reads an
        RMS-normed x of |x| ≈ √ne0."""
        return logit_std / math.sqrt(ne0)

    def head_count_kv(self, p: Preset, nextn: int = 0) -> int | list[int]:
        """attention.head_count_kv: one count, or one per block (the `nextn` NextN/MTP blocks
        after the decoder's included, as llama.cpp's converter counts them)."""
        return p.n_head_kv

    def attention_metadata(self, w: GGUFWriter, p: Preset, nextn: int = 0) -> None:
        """The attention's keys, written right after rope.freq_base (`nextn`: head_count_kv's)."""
        w.add_head_count_kv(self.head_count_kv(p, nextn))
        if self.head_dim_in_config or p.head_dim != p.n_embd // p.n_head:
            w.add_key_length(p.head_dim)
            w.add_value_length(p.head_dim)

    def metadata(self, w: GGUFWriter, p: Preset) -> None:
        """The family's own keys, written after the attention's and before the tokenizer's."""
        return None  # a body, so the hook has a default (mypy takes an empty one for abstract)

    def chat_template(self) -> str:
        """The chat template made files carry: chat_template.jinja beside the family's plan.py."""
        return (Path(inspect.getfile(type(self))).parent / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
