"""DeepSeek-V2/V3 (latent attention, grouped routing): GGUF arch deepseek2.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § deepseek2.
"""
