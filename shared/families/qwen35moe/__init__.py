"""Qwen3.5/3.6 MoE, the hybrid of gated-delta-rule and full attention layers: GGUF arch qwen35moe.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § qwen35moe.
"""
