"""Gemma 4 MoE (Gemma-4-26B-A4B): GGUF arch gemma4.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § gemma4.
"""
