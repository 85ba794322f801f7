"""The model families: one folder each (`qwen3moe/`, `gpt_oss/`, ...) holding
everything that is that family's own, and `registry`, the `Family` table that
every shared layer looks a family up in (docs/adding-a-family.md).

Owns: the family table; each family's GGUF reader and tensor table, forward
pass, converter rules, make-model plan and presets. May import: the registry
imports nothing of the project; each part of a family's folder imports only
what the layer it plugs into may (registry.py lists the parts;
tests/test_layering.py checks them).
"""
