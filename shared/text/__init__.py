"""Text in and out: the GGUF tokenizer, chat templates (rendered in a
sandbox), sampling, and the generation loop that ties them to a model.

Owns: tokens <-> text and the choice of the next token. May import: errors,
gguf, model.
"""
