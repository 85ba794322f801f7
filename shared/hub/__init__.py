"""Getting a model: the catalog of models moe-pipe knows, the Hugging Face
Hub client of `moe-pipe pull` (listing a repository's GGUFs, resumable
verified downloads), and where pulled models are kept and found again.

Owns: `catalog` (the known models, their repositories, quants and recipes),
`client` (the Hub: listing, choosing a quant, downloading, verifying),
`network` (failing fast when the Hub cannot be reached; retries as one line),
`store` (the models folder and the record of what was pulled), `resolve`
(the model file a config names: the pulled file of its catalog entry, the
embedded tiny model, or the error that says how to get one), `header` (a
GGUF's header by HTTP range request, kept on disk) and `preview` (a catalog
model not pulled, opened from that header or, offline, from the header
make-model writes for its shape: a forecast before the download).
May import: errors, progress, data, config, gguf, makemodel (its cache folder
and the embedded tiny model).
"""
