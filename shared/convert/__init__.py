"""`moe-pipe convert`: a Hugging Face checkpoint (safetensors) to a GGUF with
llama.cpp's names and conventions, one architecture's rules at a time.

Owns: the checkpoint reader, the per-architecture rules, the tokenizer copy.
May import: errors, quant, gguf.
"""
