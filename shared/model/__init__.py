"""The forward pass: the shared blocks every family's pass is built from
(norms, RoPE, attention, the MoE block, the layer loop in `base`), the
expert sources the MoE block reads from, route traces (record, replay), and
a prompt's pass watched (`prompt_watch`: its progress, where a Stop ends it).
Each family's own pass is its model part, shared/families/<family>/model.py,
exporting `Model`; `load.load_model` finds it through the family registry.

Owns: numerics of a token's pass, the KV cache, routing. May import: errors,
quant, gguf, the family registry (and the families' model parts, which rank as
this layer).
"""
