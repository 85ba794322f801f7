"""The GGUF layer: the file reader (bounded, zero-copy views), the model spec
read from its metadata, the byte-range layout of every expert and of the dense
set, the opened model file, and the vocab builder for made models.

Owns: every fact read from a GGUF file. May import: errors, quant.blocks.
"""
