"""The forward pass: one module per GGUF architecture (each exporting `Model`),
built from shared blocks (norms, RoPE, attention, the MoE block), plus the
expert sources the MoE block reads from and route traces (record, replay).

Owns: numerics of a token's pass, the KV cache, routing. `load.load_model`
picks the architecture. May import: errors, quant, gguf.
"""
