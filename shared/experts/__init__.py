"""The expert cache and its I/O: the slab table and its eviction policies,
the residency index and the shared-memory arenas, slab placement, the
O_DIRECT reads and their lanes, the dense set, the memory budget, and the
hot set a service keeps across restarts.

Owns: where each expert's bytes live and how they get there. May import:
errors, config (the policy names), quant, gguf, model (the expert views it hands
to the forward pass).
"""
