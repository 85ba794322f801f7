"""The deepseek4 family: DeepSeek-V4 (GGUF arch `deepseek4`; HF `deepseek_v4`): compressed
sparse attention with a lightning indexer, hyper-connections, hash and sqrt-softplus routing
(docs/models.md § deepseek4)."""
