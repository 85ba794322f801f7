"""`moe-pipe convert`: a Hugging Face checkpoint (safetensors) to a GGUF with
llama.cpp's names and conventions, by the rules of the checkpoint's family.

Owns: the checkpoint reader (`source`), the building blocks of the rules
(`plan`), the interface every family's convert part exports and its lookup
(`rules`), the tokenizer copy (`vocab`) and the writer (`converter`). Each
family's own rules are its part shared/families/<family>/convert.py.
May import: errors, the family registry, quant, gguf, text.
"""
