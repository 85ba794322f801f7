"""Mixtral, which llama.cpp writes as a Llama with experts: GGUF arch llama.

Everything that is this family's own, one part per layer (shared/family_registry.py);
docs/models.md § mixtral.
"""
