"""Ling 3.0 (hybrid Kimi Delta Attention + gated latent attention, grouped sigmoid routing):
GGUF arch bailingmoe3.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § bailingmoe3.
"""
