"""`moe-pipe make-model`: deterministic GGUFs with random weights in real
quant types, at tiny sizes for tests or the real models' shapes for
benchmarks, and the embedded default model.

Owns: the maker (`maker`), what it asks of a family (`part.PlanPart`, which
each family's shared/families/<family>/plan.py provides and `plans` looks up
through the registry), and what the families' plans share (`presets`: the
Preset fields, the router shape, llama.cpp's Q4_K_M mix). May import: errors,
the family registry, quant, gguf, text.
"""
