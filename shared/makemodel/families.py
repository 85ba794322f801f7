"""make-model's tensor plans for the families added after the first four.

Each family has a module `shared/makemodel/plan_<family>.py` with one function,
`layer(p, i, W, F)`, that lists layer i's tensors in file order, built with the
two constructors `plan_tensors` (maker.py) passes in: `W(name, shape, role, i)`
for a weight matrix typed by the family's quant mix (presets.real_mix), and
`F(name, shape, fill)` for an F32 vector or router filled as `fill` says.
The embeddings, output norm and head are planned by maker.py as for every family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_pipe.shared.makemodel.presets import Preset

LayerPlan = Callable[[Preset, int, Callable[..., Any], Callable[..., Any]], list]

# GGUF arch -> its layer plan (each family registers itself here).
FAMILY_LAYERS: dict[str, LayerPlan] = {}


def count_attn_v(arch: str, p: Preset) -> int:
    """The attn_v tensors of the file: llama.cpp's quant mix gives the first
    few of them more bits, so the mix needs their count before the plan runs."""
    if arch in FAMILY_LAYERS:
        roles: list[str] = []
        for i in range(p.n_layer):
            FAMILY_LAYERS[arch](p, i, lambda _n, _s, role, _i=0: roles.append(role), lambda *_: None)
        return roles.count("attn_v")
    return sum(1 for i in range(p.n_layer) if (arch != "gemma4" or p.is_swa(i)) and not p.is_recurrent(i))
