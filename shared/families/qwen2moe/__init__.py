"""Qwen1.5/Qwen2-MoE (a gated shared expert): GGUF arch qwen2moe.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § qwen2moe.
"""
