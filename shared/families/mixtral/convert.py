"""`moe-pipe convert` rules for Mixtral (HF model_type `mixtral` -> GGUF arch `llama`).

llama.cpp writes Mixtral as a Llama with experts: `llama.*` keys with
expert_count > 0, the experts as stacked `ffn_*_exps` tensors (one tensor per
projection, not one per expert), feed_forward_length = the experts' width.
Like llama.cpp's converter, the rows of attn_q and attn_k are permuted from
HF's rotate-half order to adjacent pairs (its `llama` RoPE; this family's forward pass
undoes it). Checkpoints come in two forms: transformers 5's fused
`mlp.experts.gate_up_proj`, and the published per-expert
`block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down). The tokenizer is
Mistral's SentencePiece or, as llama.cpp's converter also takes, a Llama-3-style
byte-level BPE (`gpt2`, pre-split `llama-bpe`). docs/models.md § mixtral.

Legend (numpy order): D hidden, H q heads, Hk kv heads, d head dim, X experts, F expert ff width.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFWriter

from ...convert.plan import (
    Out,
    Planner,
    add_rope_scaling,
    base_hparams,
    cfg_get,
    common_meta,
    embeddings,
    finish,
    head,
    qwen_experts,
    stack,
)
from ...convert.rules import Arch, TokenizerFacts
from ...convert.source import Checkpoint
from ...convert.vocab import as_written
from ...errors import UserError
from ...gguf.vocab import LLAMA3_REGEX


def hparams(cfg: dict) -> dict[str, Any]:
    hp = base_hparams(cfg, 1e6)
    hp.update(
        X=int(cfg_get(cfg, "num_local_experts", ..., "num_experts")),
        K=int(cfg_get(cfg, "num_experts_per_tok")),
        F=int(cfg_get(cfg, "intermediate_size")),
    )
    hp["Fd"] = hp["F"]  # llama.cpp sizes a llama file's experts by feed_forward_length
    window = cfg.get("sliding_window")
    if window and int(window) < hp["ctx"]:
        # transformers would mask beyond the window; llama.cpp's llama graph attends to everything.
        raise UserError(
            f"config.json: sliding_window {window} is not supported for mixtral (llama.cpp runs it with full attention); "
            "Mixtral 8x7B/8x22B have sliding_window null"
        )
    if hp["d"] % 2:
        raise UserError(f"config.json: head_dim {hp['d']} must be even (RoPE rotates pairs)")
    return hp


def metadata(w: GGUFWriter, hp: dict[str, Any]) -> None:
    common_meta(w, hp)
    w.add_vocab_size(hp["V"])
    w.add_head_count_kv(hp["Hk"])
    w.add_key_length(hp["d"])
    w.add_value_length(hp["d"])
    w.add_rope_dimension_count(hp["d"])
    add_rope_scaling(w, hp["rope"], hp["ctx"])


def to_pairs(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from rotate-half order
    (first halves, then second halves) to adjacent pairs (0, d/2, 1, d/2+1, ...)."""
    return np.ascontiguousarray(x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape))


def plan(hp: dict[str, Any], ck: Checkpoint) -> list[Out]:
    D, H, Hk, d, X, F = hp["D"], hp["H"], hp["Hk"], hp["d"], hp["X"], hp["F"]
    p = Planner(ck, "model.")

    def permuted(gg: str, name: str, shape: tuple[int, int], heads: int) -> None:
        full = p.hf(name, shape)
        p.add(Out(gg, shape, True, lambda: iter([to_pairs(ck.f32(full), heads)])))

    embeddings(p, hp)
    head(p, hp, "lm_head.weight")
    fused = "model.layers.0.mlp.experts.gate_up_proj" in ck
    for i in range(hp["L"]):
        b, h = f"blk.{i}.", f"layers.{i}."
        a = h + "self_attn."
        p.f32(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        permuted(b + "attn_q.weight", a + "q_proj.weight", (H * d, D), H)
        permuted(b + "attn_k.weight", a + "k_proj.weight", (Hk * d, D), Hk)
        p.copy(b + "attn_v.weight", a + "v_proj.weight", (Hk * d, D))
        p.copy(b + "attn_output.weight", a + "o_proj.weight", (D, H * d))
        p.f32(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        if fused:  # transformers 5
            p.f32(b + "ffn_gate_inp.weight", h + "mlp.gate.weight", (X, D))
            qwen_experts(p, b, h + "mlp.experts.", hp)
        else:  # the published checkpoints: w1 gate, w3 up, w2 down
            m = h + "block_sparse_moe."
            p.f32(b + "ffn_gate_inp.weight", m + "gate.weight", (X, D))
            stack(p, b + "ffn_gate_exps.weight", [f"{m}experts.{x}.w1.weight" for x in range(X)], (F, D))
            stack(p, b + "ffn_up_exps.weight", [f"{m}experts.{x}.w3.weight" for x in range(X)], (F, D))
            stack(p, b + "ffn_down_exps.weight", [f"{m}experts.{x}.w2.weight" for x in range(X)], (D, F))
    return finish(p, ck)


# Mistral's SentencePiece (scores, no merges), or a Llama-3-style byte-level BPE, which llama.cpp's
# converter writes as "gpt2" with the pre-split "llama-bpe" (its hash of Llama-3's tokenizer)
_BYTE_LEVEL = TokenizerFacts("gpt2", "llama-bpe", add_bos=True, known_pre={as_written(LLAMA3_REGEX): "llama-bpe"})
_TOKENIZER = TokenizerFacts("llama", "default", add_bos=True, byte_pieces=True, sentencepiece=True, byte_level=_BYTE_LEVEL)
ARCHES = {"mixtral": Arch("llama", hparams, metadata, plan, _TOKENIZER)}
