"""DeepSeek-V2/V3 (GGUF arch `deepseek2`; HF DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).

Multi-head latent attention (MLA), computed the way llama.cpp does it, with the
up-projections absorbed, so the cache holds one compressed row per position:
    q      = attn_q·n, or attn_q_b·RMSNorm(attn_q_a·n)          [T, H, nope + rope]
    c, kp  = attn_kv_a_mqa·n → RMSNorm(first r values), the rest [T, r], [T, rope]
    q̂_h    = attn_k_b[h]·q_nope_h                               [T, H, r]
    K = [c, RoPE(kp)] (one head, cached), V = c (K's first r values: not stored again)
    o_h    = softmax(s·[q̂_h, RoPE(q_rope_h)]·Kᵀ)·V               [T, H, r]
    out    = attn_output·concat_h(attn_v_b[h]·o_h)
with r = kv_lora_rank and s = mscale²/√(nope + rope) (mscale = 1 + 0.1·mscale_all_dim·ln factor
under YaRN, else 1). RoPE is the interleaved kind (pairs 2i, 2i+1; llama.cpp's NORM mode):
both q's and k's rope parts are de-interleaved first, after which the rotate-half kernel
gives the same dot products. Layers 0..n_dense_lead-1 have a dense SwiGLU FFN; the others
route (softmax or sigmoid, correction bias for the choice only, grouped top-k, norm, scale:
model/moe.py gated_group_top_k) and add the always-on shared experts (no gate).
docs/models.md § deepseek2. Legend: T tokens, D hidden, H heads, r kv_lora_rank.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import quant
from ...errors import GGUFError
from ...gguf.model_file import ModelFile
from ...model.attend import attend
from ...model.base import MoEModel
from ...model.blocks import KVCache, Rope, per_sequence, plain_inv_freq, rms_norm, swiglu, yarn_rope
from ...model.moe import Routing, apply_experts, route_as_spec, swiglu_expert
from ...model.weights import QWeight, _as_matrix


def deinterleave(x: np.ndarray) -> np.ndarray:
    """[..., 2n] with pairs (2i, 2i+1) → [..., 2n] with pairs (i, i+n): the interleaved
    rotation becomes the rotate-half one, and q·k is unchanged (both move alike)."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def per_head(mats: list[QWeight], x: np.ndarray) -> np.ndarray:
    """Head h's matrix on x[:, h] for every head: x [T, H, cols] → [T, H, rows]. A decoded
    token's heads take one kernel call (quant.gather_apply, each head's row its own
    activation) where a call per head pays a rounding and a parallel region each; the
    same numbers bit for bit. A prompt's rows, or float-typed heads: one call per head."""
    if x.shape[0] == 1:
        out = quant.gather_apply([m.prep for m in mats], x[0], np.arange(len(mats), dtype=np.int64))
        if out is not None:
            return out[None]
    return np.stack([m(np.ascontiguousarray(x[:, h])) for h, m in enumerate(mats)], axis=1)


def mla_attention(q: np.ndarray, cache: KVCache, layer: int, start: int, scale: float, r: int) -> np.ndarray:
    """Causal attention of q [T, H, r + rope] over the one cached latent head, whose
    first r values are also the value: returns [T, H, r]. Over a batch of sequences, each
    sequence's queries over its own cache."""
    if cache.batched:
        return per_sequence(cache, start, lambda c, s, q: mla_attention(q, c, layer, s, scale, r), q)
    t, h, d = q.shape
    n = start + t
    stored = cache.stored(layer)
    if stored is not None:  # f32 / f16: the attention kernel, V the first r columns of K
        k = stored[0]  # [1, n_ctx, r + rope]: each key's first r columns are its value
        return attend(q.reshape(t, 1, h, d), k, r, 0, start, 0, scale, None).reshape(t, h, r)
    keys = cache.keys(layer, 0, n)[0]  # q8_0: float32 [N, r + rope]
    if cache.rows_alone:  # a verify pass: each row over its own keys, as its decode step computes it
        return np.concatenate([_mla_q8(q[a : a + 1], keys[: start + a + 1], start + a, scale, r) for a in range(t)])
    return _mla_q8(q, keys, start, scale, r)


def _mla_q8(q: np.ndarray, keys: np.ndarray, start: int, scale: float, r: int) -> np.ndarray:
    """mla_attention on dequantized keys [N, r + rope] for queries at start.. (causal)."""
    n = keys.shape[0]
    scores = np.einsum("thd,nd->htn", q, keys) * np.float32(scale)  # [H, T, N]
    hidden = np.arange(n)[None, :] > np.arange(start, n)[:, None]  # [T, N]
    scores = np.where(hidden[None], np.float32(-np.inf), scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    return np.einsum("htn,nr->thr", probs, keys[:, :r]).astype(np.float32)


class Model(MoEModel):
    arch = "deepseek2"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        super().__init__(mf, **kwargs)
        s, r = self.spec, self.spec.rope
        if r.scaling == "yarn":
            # llama.cpp's deepseek2 keeps the rotation unit-sized and puts YaRN's magnitude
            # correction on the whole score instead (mscale², below).
            self.rope = Rope(yarn_rope(r, r.dim, True).inv_freq, 1.0)
            mscale = 1.0 + 0.1 * s.rope_yarn_log_mul * math.log(r.factor)
        else:
            self.rope = Rope(plain_inv_freq(r.freq_base, r.dim))
            mscale = 1.0
        self.scale = mscale * mscale / math.sqrt(s.head_dim_k_mla)

    def load_layer(self, i: int) -> dict:
        return {**self.load_attention(i), **self.load_ffn(i)}

    def load_attention(self, i: int) -> dict[str, Any]:
        """Layer i's MLA weights (bailingmoe3 reuses them on its MLA layers)."""
        p, w, s = f"blk.{i}.", self.w, self.spec
        L: dict[str, Any] = dict(
            kv_a=w.matrix(p + "attn_kv_a_mqa.weight"),
            kv_norm=w.vector(p + "attn_kv_a_norm.weight"),
            k_b=self._per_head(p + "attn_k_b.weight"),
            v_b=self._per_head(p + "attn_v_b.weight"),
            o=w.matrix(p + "attn_output.weight"),
        )
        if s.q_lora_rank:
            L.update(q_a=w.matrix(p + "attn_q_a.weight"), q_norm=w.vector(p + "attn_q_a_norm.weight"), q_b=w.matrix(p + "attn_q_b.weight"))
        else:
            L.update(q=w.matrix(p + "attn_q.weight"))
        return L

    def load_ffn(self, i: int) -> dict[str, Any]:
        """Layer i's norms and FFN: a leading dense layer's, or the router and the shared experts."""
        p, w, s = f"blk.{i}.", self.w, self.spec
        L: dict[str, Any] = dict(attn_norm=w.vector(p + "attn_norm.weight"), ffn_norm=w.vector(p + "ffn_norm.weight"))
        if not s.has_experts(i):
            L.update(gate=w.matrix(p + "ffn_gate.weight"), up=w.matrix(p + "ffn_up.weight"), down=w.matrix(p + "ffn_down.weight"))
            return L
        L.update(router=w.matrix(p + "ffn_gate_inp.weight"), bias=w.optional_vector(p + "exp_probs_b.bias"))
        if s.n_expert_shared:
            L.update(
                sh_gate=w.matrix(p + "ffn_gate_shexp.weight"),
                sh_up=w.matrix(p + "ffn_up_shexp.weight"),
                sh_down=w.matrix(p + "ffn_down_shexp.weight"),
            )
        return L

    def _per_head(self, name: str) -> list[QWeight]:
        """A [H, rows, cols] tensor (attn_k_b, attn_v_b) as one matrix per head, on its bytes."""
        t = self.mf.gguf.tensor(name)
        if len(t.shape) != 3:
            raise GGUFError(self.mf.gguf.path, f"tensor {name!r} should be [heads, rows, cols], has shape {list(t.shape)}")
        data = np.asarray(self.w.view(name))
        heads, rows = t.shape[0], t.shape[1]
        flat = data.reshape(heads * rows, -1)
        scale = self.w.scale_of(name)
        return [_as_matrix(name, t.qtype, flat[h * rows : (h + 1) * rows], t.shape[1:], scale) for h in range(heads)]

    def guess_layer(self, j: int, router_input: np.ndarray) -> None:
        if self.spec.has_experts(j):  # a leading dense layer has nothing to guess
            super().guess_layer(j, router_input)

    def route(self, i: int, scores: np.ndarray) -> Routing:
        """The file's scoring function, selection bias and expert groups (route_as_spec)."""
        return route_as_spec(self.spec, scores, self.top_k, self.layers[i]["bias"])

    def layer(self, i, x, cache, start, positions):
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        with self.stage("attention"):
            h = x + self.attention(i, rms_norm(x, L["attn_norm"], eps), cache, start, positions)
        n2 = rms_norm(h, L["ffn_norm"], eps)
        if not s.has_experts(i):
            with self.stage("dense_mlp"):
                return h + L["down"](swiglu(L["gate"](n2), L["up"](n2)))
        with self.stage("router"):
            scores = L["router"](n2)
            routing = self.routed(i, scores)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            y = apply_experts(n2, routing, self.source, i, swiglu_expert)
        if not s.n_expert_shared:
            return h + y
        with self.stage("dense_mlp"):  # the shared experts: always on, resident, no gate
            shared = L["sh_down"](swiglu(L["sh_gate"](n2), L["sh_up"](n2)))
        return h + (y + shared)

    def attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        return self.layers[i]["o"](self.latent_attention(i, n, cache, start, positions))

    def latent_attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        """MLA up to the output projection: each head's values, [T, H·v]."""
        s, L, eps = self.spec, self.layers[i], self.spec.rms_eps
        t, heads, r, rope = n.shape[0], s.n_head, s.kv_lora_rank, s.rope.dim
        nope = s.head_dim_k_mla - rope
        q = L["q_b"](rms_norm(L["q_a"](n), L["q_norm"], eps)) if s.q_lora_rank else L["q"](n)
        q = q.reshape(t, heads, nope + rope)
        kv = L["kv_a"](n)  # [T, r + rope]
        latent = rms_norm(kv[:, :r], L["kv_norm"], eps)
        cos, sin = self.rope.tables(positions)
        k_rope = self.rope.apply(deinterleave(kv[:, None, r:]), cos, sin)  # [T, 1, rope]
        q_rope = self.rope.apply(deinterleave(q[:, :, nope:]), cos, sin)  # [T, H, rope]
        absorbed = per_head(L["k_b"], np.ascontiguousarray(q[:, :, :nope]))  # [T, H, r]
        del q  # a prompt chunk's arrays: none kept past its use (prefill_activation_bytes)
        cache.store(i, np.concatenate([latent[:, None], k_rope], axis=-1), np.empty((t, 1, 0), np.float32))
        del kv, latent, k_rope
        query = np.concatenate([absorbed, q_rope], axis=-1)
        del absorbed, q_rope
        o = mla_attention(query, cache, i, start, self.scale, r)  # [T, H, r]
        del query
        return per_head(L["v_b"], o).reshape(t, -1)  # [T, H·v]
