"""The model families: one folder each (`qwen3moe/`, `gpt_oss/`, ...) holding
everything that is that family's own, listed in shared/family_registry.py, the
`Family` table every shared layer looks a family up in (docs/adding-a-family.md).

Owns: each family's GGUF reader and tensor table, forward pass, converter
rules, make-model plan, presets and chat template. May import: each part of a
family's folder imports only what the layer it plugs into may
(family_registry.PARTS; tests/test_layering.py checks them).
"""
