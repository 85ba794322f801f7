"""make-model's tensor plans for the families added after the first four.

Each family has a module `shared/makemodel/plan_<family>.py` with its presets
(`PRESETS`) and a function `layer(p, i, W, F)` that lists layer i's tensors in file order, built with the
two constructors `plan_tensors` (maker.py) passes in: `W(name, shape, role, i)`
for a weight matrix typed by the family's quant mix (presets.real_mix), and
`F(name, shape, fill)` for an F32 vector or router filled as `fill` says.
The embeddings, final norm and head are planned by maker.py as for every family,
with the names and tying of FINAL_NORM and TIED_HEAD below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_pipe.shared.makemodel import plan_deepseek2, plan_glm4moe, plan_lfm2moe, plan_mixtral, plan_qwen2moe
from moe_pipe.shared.makemodel.presets import Preset

LayerPlan = Callable[[Preset, int, Callable[..., Any], Callable[..., Any]], list]

# GGUF arch -> its layer plan (each family registers itself here).
FAMILY_LAYERS: dict[str, LayerPlan] = {
    "llama": plan_mixtral.layer,
    "glm4moe": plan_glm4moe.layer,
    "lfm2moe": plan_lfm2moe.layer,
    "deepseek2": plan_deepseek2.layer,
    "qwen2moe": plan_qwen2moe.layer,
}
# GGUF arch -> its presets by name (presets.get_preset looks here for the later families).
FAMILY_PRESETS: dict[str, dict[str, Preset]] = {
    "llama": plan_mixtral.PRESETS,
    "glm4moe": plan_glm4moe.PRESETS,
    "lfm2moe": plan_lfm2moe.PRESETS,
    "deepseek2": plan_deepseek2.PRESETS,
    "qwen2moe": plan_qwen2moe.PRESETS,
}
# GGUF arch -> the family's own metadata keys, written after every family's
# (maker._add_metadata): (writer, preset) -> None.
FAMILY_META: dict[str, Callable[[Any, Preset], None]] = {
    "glm4moe": plan_glm4moe.metadata,
    "lfm2moe": plan_lfm2moe.metadata,
    "deepseek2": plan_deepseek2.metadata,
    "qwen2moe": plan_qwen2moe.metadata,
}
# What maker.py plans differently for a family (lfm2moe, as llama.cpp writes it): the final
# norm's name where it is not output_norm.weight, a head tied to token_embd (no output.weight),
# kv heads per layer (0: no attention), and a vocabulary build_vocab does not make.
FINAL_NORM: dict[str, str] = {"lfm2moe": "token_embd_norm.weight"}
TIED_HEAD = frozenset({"gemma4", "lfm2moe"})
FAMILY_KV: dict[str, Callable[[Preset], list[int]]] = {"lfm2moe": plan_lfm2moe.head_count_kv}
FAMILY_VOCAB: dict[str, Callable[[int, int], Any]] = {
    "lfm2moe": plan_lfm2moe.vocab,
    "deepseek2": plan_deepseek2.vocab,
    "qwen2moe": plan_qwen2moe.vocab,
}


def count_attn_v(arch: str, p: Preset) -> int:
    """The attn_v tensors of the file: llama.cpp's quant mix gives the first
    few of them more bits, so the mix needs their count before the plan runs."""
    if arch in FAMILY_LAYERS:
        roles: list[str] = []
        for i in range(p.n_layer):
            FAMILY_LAYERS[arch](p, i, lambda _n, _s, role, _i=0: roles.append(role), lambda *_: None)
        return roles.count("attn_v")
    return sum(1 for i in range(p.n_layer) if (arch != "gemma4" or p.is_swa(i)) and not p.is_recurrent(i))
