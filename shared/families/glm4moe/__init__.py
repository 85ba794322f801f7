"""GLM-4.5/4.6 MoE (GLM-4.5-Air): GGUF arch glm4moe.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § glm4moe.
"""
