"""LFM2-MoE, the short-conv hybrid (LFM2-8B-A1B): GGUF arch lfm2moe.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § lfm2moe.
"""
