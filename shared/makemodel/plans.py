"""Every family's make-model plan part (shared/families/<family>/plan.py
`PLAN`), found through the family registry, and what make-model lists from
them: the archs, the preset names, and which arch each shape preset is made for.
"""

from __future__ import annotations

from ..family_registry import FAMILIES, Family, by_name
from .part import PlanPart
from .presets import SHARED_PRESETS, Preset


def _plan_part(family: Family) -> PlanPart:
    part: PlanPart = family.part("plan").PLAN
    return part


# GGUF arch -> its family's plan part, in the registry's order.
PARTS: dict[str, PlanPart] = {f.arch: _plan_part(f) for f in FAMILIES}
ARCHES: tuple[str, ...] = tuple(PARTS)
# tiny and small, then each family's real shapes, in the registry's order.
PRESETS: tuple[str, ...] = tuple(dict.fromkeys(name for part in PARTS.values() for name in part.presets))
SHAPE_PRESET_ARCH: dict[str, str] = {name: arch for arch, part in PARTS.items() for name in part.presets if name not in SHARED_PRESETS}


def plan_part(arch: str) -> PlanPart:
    """The plan part of the family with this GGUF arch or own name (registry.by_name); KeyError if none."""
    family = by_name(arch)
    if family is None:
        raise KeyError(arch)
    return PARTS[family.arch]


def get_preset(arch: str, preset: str) -> Preset | None:
    """The preset of that name for this arch (or family name); None where the family has none such."""
    family = by_name(arch)
    return None if family is None else PARTS[family.arch].presets.get(preset)
