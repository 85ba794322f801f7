"""`moe-pipe make-model`: deterministic GGUFs with random weights in real
quant types, at tiny sizes for tests or the real models' shapes for
benchmarks, and the embedded default model.

Owns: the shape presets and the maker. May import: errors, quant, gguf.
"""
