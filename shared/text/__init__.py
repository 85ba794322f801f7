"""Text in and out: the GGUF tokenizer, chat templates (rendered in a
sandbox), sampling, the generation loop that ties them to a model, and a
reply read back: reasoning, answer and tool calls (reasoning, tools).

Owns: tokens <-> text and the choice of the next token. May import: errors,
gguf, model.
"""
