"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GGUF arch gpt-oss.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § gpt-oss.
"""
