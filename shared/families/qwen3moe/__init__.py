"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GGUF arch qwen3moe.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § qwen3moe.
"""
