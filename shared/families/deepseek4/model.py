"""DeepSeek-V4 (GGUF arch `deepseek4`; HF DeepseekV4ForCausalLM). docs/models.md § deepseek4.

The residual is N = hc_mult streams [T, N, D]. Around each block a hyper-connection
(`mix`) collapses them into the block's input with weights `pre`, and after it puts
back post·block + combᵀ·streams (comb doubly stochastic by Sinkhorn). The output head
collapses the streams once more (`pre` only), then RMS norm and `output`.

Attention: q = RMSNorm₀(attn_q_b·RMSNorm(attn_q_a·n)) per head, one kv head
kv = RMSNorm(attn_kv·n) that is both key and value; the last rope dims of both
rotate (interleaved pairs). A query sees the raw keys of its sliding window plus
compressed entries: an HCA layer folds every `ratio` positions into one entry
(softmax-gated sum of the compressor's kv rows, RMS norm, rope at the window's first
position); a CSA layer (ratio 4) folds overlapping windows of 8 (the previous
window's first half of the rows, this window's second half) and keeps only the
entries a lightning indexer ranks in its top k. Softmax with a sink logit per head;
the output's rope dims are rotated back, then the grouped output projection
(attn_output_a per head group, attn_output_b over the groups).

MoE: sqrt(softplus(logits)) scores; hash layers take their experts from the token id
(ffn_gate_tid2eid), the others the top k of scores + exp_probs_b; weights are the
chosen scores, normalized, scaled. Experts and the shared expert are SwiGLU with
the gate clamped above and the up clamped both ways at `swiglu_limit`.

The cache is compact (spec.py): the raw keys of each layer's window in a ring, the
entries folded once, each as its window completes, and the compressor rows only while a
fold still reads them (a ring too). A sequence's rows go in prompt blocks: store the
block's keys and rows, fold the windows it completes (one fold per block, window by
window the same numbers: `fold_entries`), then its queries attend; a decode step is a
block of one, so a window completing inside a prompt and in a decode step folds alike.
Legend: T tokens, N streams, D hidden, H heads, d head_dim, R rope dims, M entries.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import GGUFError
from ...gguf.model_file import ModelFile
from ...gguf.spec import RopeSpec
from ...model.base import MoEModel
from ...model.blocks import KVCache, per_sequence, plain_inv_freq, rms_norm, sigmoid, softmax, swiglu, yarn_rope
from ...model.moe import GLU_EXPERTS, Routing, apply_experts, top_k_ids
from ...model.weights import Expert, QWeight, _as_matrix
from .spec import CSA_RATIO, V4Facts, facts

# ---- hyper-connections ---------------------------------------------------------


def hc_mix(hc: dict, x: np.ndarray, eps: float, hc_eps: float, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, N, D] → (post [T, N], comb [T, N, N], the block's input [T, D])."""
    t, n, d = x.shape
    mixes = hc["fn"](rms_norm(x.reshape(t, n * d), None, eps))  # [T, (2 + N)·N]
    scale, base = hc["scale"], hc["base"]
    pre = sigmoid(mixes[:, :n] * scale[0] + base[:n]) + np.float32(hc_eps)
    post = np.float32(2) * sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = softmax((mixes[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(t, n, n), axis=-1).astype(np.float32) + np.float32(hc_eps)
    # Sinkhorn: columns first, then rows and columns in turn (transformers' and llama.cpp's order)
    comb = comb / (comb.sum(axis=1, keepdims=True) + np.float32(hc_eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=2, keepdims=True) + np.float32(hc_eps))
        comb = comb / (comb.sum(axis=1, keepdims=True) + np.float32(hc_eps))
    return post, comb, np.einsum("tn,tnd->td", pre, x).astype(np.float32)


def hc_put_back(y: np.ndarray, x: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Streams after a block: post[k]·y + Σ_j comb[j, k]·x[j]; y [T, D], x [T, N, D]."""
    return (post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, x)).astype(np.float32)


# ---- rope, interleaved on the last R dims -----------------------------------------


def angles(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [P, R/2] at any positions (compressed entries sit every `ratio` positions)."""
    a = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(a), np.sin(a)


def rotate_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [P, h, d]: pairs (d−R+2i, d−R+2i+1) rotated by angle i of their row; the rest kept."""
    r = 2 * cos.shape[-1]
    d = x.shape[-1]
    out = np.array(x, dtype=np.float32)
    a, b = x[..., d - r :: 2], x[..., d - r + 1 :: 2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., d - r :: 2] = a * c - b * s
    out[..., d - r + 1 :: 2] = a * s + b * c
    return out


# ---- compression ----------------------------------------------------------------------


def fold_entries(kv: np.ndarray, gate: np.ndarray, ape: np.ndarray, norm: np.ndarray, ratio: int, overlap: bool, eps: float) -> np.ndarray:
    """The compressed entries of consecutive complete windows, before rope: kv, gate [W·ratio, w]
    rows (gate without its position bias `ape` [ratio, w]). Without `overlap` each window folds
    into one entry, [W, w]. With it entry m folds window m−1's first halves with window m's
    second halves, so the W windows' rows give W − 1 entries [W − 1, w/2], the first window
    lending only its first halves (before window 0 stands `no_window`). Every operation is
    per entry (a reduction over its own window), so folding windows one by one or several at
    once gives the same bits (tests/test_deepseek4.py)."""
    m = kv.shape[0] // ratio
    kv = kv.reshape(m, ratio, -1)
    g = gate.reshape(m, ratio, -1) + ape[None]
    if overlap:
        w = kv.shape[-1] // 2
        kv = np.concatenate([kv[:-1, :, :w], kv[1:, :, w:]], axis=1)  # [W − 1, 2·ratio, w]
        g = np.concatenate([g[:-1, :, :w], g[1:, :, w:]], axis=1)
    p = softmax(g, axis=1).astype(np.float32)
    return rms_norm((kv * p).sum(axis=1), norm, eps)


def no_window(ratio: int, width: int) -> np.ndarray:
    """The compressor rows [ratio, width] an overlapping fold reads before window 0, laid out as
    a kv half then a gate half: kv 0 and gates −∞ (softmax weight 0)."""
    half = width // 2
    return np.concatenate([np.zeros((ratio, half), np.float32), np.full((ratio, half), -np.inf, np.float32)], axis=1)


def top_k_of(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best of one query's scores (all of them when fewer), as positions into `scores`."""
    return top_k_ids(scores[None, :], min(k, scores.shape[0]))[0]


def attend_with_entries(
    q: np.ndarray,
    raw: np.ndarray,
    raw_lo: int,
    entries: np.ndarray,
    seen: list[np.ndarray],
    positions: np.ndarray,
    window: int,
    scale: float,
    sinks: np.ndarray,
) -> np.ndarray:
    """q [T, H, d] over the raw keys raw [N, d] (positions raw_lo..) in each query's window and
    the entries [M, d] it sees (seen[t]: their indices); keys are values; a sink logit per head.
    → [T, H, d]. Row by row over exactly the keys the row sees: a row in a batch computes what
    it computes alone (a decode step), so the matmuls after it see the same bits."""
    out = np.empty_like(q)
    sink = sinks.astype(np.float32)[:, None]  # [H, 1]
    for r, p in enumerate(positions):
        lo = max(raw_lo, int(p) - window + 1)
        keys = np.concatenate([raw[lo - raw_lo : int(p) - raw_lo + 1], entries[seen[r]]])  # [N', d]
        s = (q[r] @ keys.T) * np.float32(scale)  # [H, N']
        top = np.maximum(s.max(axis=-1, keepdims=True), sink)
        e = np.exp(s - top)
        out[r] = (e @ keys) / (e.sum(axis=-1, keepdims=True) + np.exp(sink - top))
    return out


# ---- the model ---------------------------------------------------------------------------


class Model(MoEModel):
    arch = "deepseek4"

    def __init__(self, mf: ModelFile, **kwargs: Any):
        self.v4: V4Facts = facts(mf.gguf)  # load_layer reads it
        self._tokens = np.zeros(0, np.int64)
        super().__init__(mf, **kwargs)
        # its experts are gated like the others', with the file's clamp: registered so a prompt
        # and a decode step take a layer's experts several a kernel call (shared/model/moe.py)
        self._expert = self.expert
        GLU_EXPERTS[self._expert] = self.clamped_swiglu
        s, v4 = self.spec, self.v4
        self.inv_main = plain_inv_freq(s.rope.freq_base, s.rope.dim)
        r = s.rope
        if r.scaling == "yarn":  # the compressing layers' rope; unit-sized (llama.cpp and transformers agree)
            self.inv_comp = yarn_rope(
                RopeSpec(v4.compress_rope_base, r.dim, "yarn", r.factor, r.orig_ctx, 1.0, r.beta_fast, r.beta_slow), r.dim, True
            ).inv_freq
        else:
            self.inv_comp = plain_inv_freq(v4.compress_rope_base, r.dim)
        self.scale = 1.0 / math.sqrt(v4.head_dim)
        w = self.w
        self.hc_head: dict[str, Any] = dict(
            fn=w.matrix("output_hc_fn.weight"), base=w.vector("output_hc_base.weight"), scale=w.vector("output_hc_scale.weight")
        )

    # -- loading --------------------------------------------------------------------------
    def load_layer(self, i: int) -> dict:
        p, w, v4 = f"blk.{i}.", self.w, self.v4
        ratio = v4.compress_ratios[i]
        L: dict[str, Any] = dict(
            attn_norm=w.vector(p + "attn_norm.weight"),
            sinks=w.vector(p + "attn_sinks.weight"),
            q_a=w.matrix(p + "attn_q_a.weight"),
            q_a_norm=w.vector(p + "attn_q_a_norm.weight"),
            q_b=w.matrix(p + "attn_q_b.weight"),
            kv=w.matrix(p + "attn_kv.weight"),
            kv_norm=w.vector(p + "attn_kv_a_norm.weight"),
            o_a=self._groups(p + "attn_output_a.weight"),
            o_b=w.matrix(p + "attn_output_b.weight"),
            hc_attn=self._hc(p + "hc_attn_"),
            hc_ffn=self._hc(p + "hc_ffn_"),
            ffn_norm=w.vector(p + "ffn_norm.weight"),
            router=w.matrix(p + "ffn_gate_inp.weight"),
            sh_gate=w.matrix(p + "ffn_gate_shexp.weight"),
            sh_up=w.matrix(p + "ffn_up_shexp.weight"),
            sh_down=w.matrix(p + "ffn_down_shexp.weight"),
        )
        if i < v4.hash_layers:
            L["tid2eid"] = self._tid2eid(p + "ffn_gate_tid2eid.weight")
        else:
            L["bias"] = w.vector(p + "exp_probs_b.bias")
        if ratio:
            L.update(comp=self._compressor(p + "attn_compressor_", v4.comp_width(i), ratio))
        if ratio == CSA_RATIO:
            L.update(
                idx=self._compressor(p + "indexer_compressor_", 2 * v4.index_head_dim, ratio),
                idx_q_b=w.matrix(p + "indexer.attn_q_b.weight"),
                idx_proj=w.matrix(p + "indexer.proj.weight"),
            )
        return L

    def _hc(self, prefix: str) -> dict:
        w = self.w
        return dict(fn=w.matrix(prefix + "fn.weight"), base=w.vector(prefix + "base.weight"), scale=w.vector(prefix + "scale.weight"))

    def _compressor(self, prefix: str, width: int, ratio: int) -> dict:
        w = self.w
        ape = w.vector(prefix + "ape.weight")
        if ape.shape != (ratio, width):
            raise GGUFError(self.mf.gguf.path, f"tensor {prefix}ape.weight should be [{ratio}, {width}], has {list(ape.shape)}")
        return dict(
            kv=w.matrix(prefix + "kv.weight"), gate=w.matrix(prefix + "gate.weight"), ape=ape, norm=w.vector(prefix + "norm.weight")
        )

    def _groups(self, name: str) -> list[QWeight]:
        """attn_output_a [G·r, H·d/G] as one [r, H·d/G] matrix per head group, on its bytes."""
        t, g = self.mf.gguf.tensor(name), self.v4.o_groups
        s, v4 = self.spec, self.v4
        want = (g * v4.o_lora_rank, s.n_head * v4.head_dim // g)
        if tuple(t.shape) != want:
            raise GGUFError(self.mf.gguf.path, f"tensor {name!r} should be {list(want)}, has {list(t.shape)}")
        flat = np.asarray(self.w.view(name)).reshape(want[0], -1)
        r = v4.o_lora_rank
        scale = self.w.scale_of(name)
        return [_as_matrix(name, t.qtype, flat[k * r : (k + 1) * r], (r, want[1]), scale) for k in range(g)]

    def _tid2eid(self, name: str) -> np.ndarray:
        t = self.mf.gguf.tensor(name)
        want = (self.spec.n_vocab, self.spec.n_expert_used)
        if t.qtype.name != "I32" or tuple(t.shape) != want:
            raise GGUFError(self.mf.gguf.path, f"tensor {name!r} should be I32 {list(want)}, is {t.qtype.name} {list(t.shape)}")
        ids = np.asarray(self.w.view(name)).reshape(want).astype(np.int64)
        if ids.min() < 0 or ids.max() >= self.spec.n_expert:
            raise GGUFError(self.mf.gguf.path, f"tensor {name!r} names experts outside 0..{self.spec.n_expert - 1}")
        return ids

    # -- the hooks -----------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        # Hash layers route by token id: the pass's tokens, kept for its layers.
        self._tokens = np.asarray(tokens, np.int64)
        e = self.embd.rows(tokens)  # [T, D]
        return np.repeat(e[:, None, :], self.v4.hc_mult, axis=1).astype(np.float32)  # [T, N, D]

    def row_tokens(self, tokens: np.ndarray) -> None:
        self._tokens = np.asarray(tokens, np.int64)

    def logits(self, x: np.ndarray) -> np.ndarray:
        t, n, d = x.shape
        h = self.hc_head
        mixes = h["fn"](rms_norm(x.reshape(t, n * d), None, self.spec.rms_eps))  # [T, N]
        pre = sigmoid(mixes * h["scale"][0] + h["base"]) + np.float32(self.v4.hc_eps)
        return self.output(rms_norm(np.einsum("tn,tnd->td", pre, x), self.output_norm, self.spec.rms_eps))

    def router_input(self, i: int, h: np.ndarray) -> np.ndarray:
        # Only a prefetch guess reads this: the streams' mean stands in for the collapse.
        return rms_norm(h.mean(axis=1) if h.ndim == 3 else h, self.layers[i]["ffn_norm"], self.spec.rms_eps)

    def guess_layer(self, j: int, router_input: np.ndarray) -> None:
        if j < self.v4.hash_layers:  # the token id decides: no guess needed
            self.source.prefetch(j, list(dict.fromkeys(int(e) for e in self.layers[j]["tid2eid"][self._tokens].reshape(-1))))
            return
        super().guess_layer(j, router_input)

    def routes_by_scores(self, j: int) -> bool:
        return j >= self.v4.hash_layers and super().routes_by_scores(j)  # a hash layer's experts are the token's

    # -- one block -----------------------------------------------------------------------
    def layer(self, i, x, cache, start, positions):
        L, v4, eps = self.layers[i], self.v4, self.spec.rms_eps
        with self.stage("attention"):
            post, comb, a_in = hc_mix(L["hc_attn"], x, eps, v4.hc_eps, v4.hc_sinkhorn_iters)
            a = self.attention(i, rms_norm(a_in, L["attn_norm"], eps), cache, start, positions)
            x = hc_put_back(a, x, post, comb)
            post, comb, f_in = hc_mix(L["hc_ffn"], x, eps, v4.hc_eps, v4.hc_sinkhorn_iters)
            n2 = rms_norm(f_in, L["ffn_norm"], eps)
        with self.stage("router"):
            logits = L["router"](n2)  # [T, E]
            routing = self.routed(i, logits)
            self.hint_next_layer(i, n2)
        with self.stage("experts"):
            y = apply_experts(n2, routing, self.source, i, self.expert)
        with self.stage("dense_mlp"):  # the shared expert: always on, resident
            y = y + L["sh_down"](self.clamped_swiglu(L["sh_gate"](n2), L["sh_up"](n2)))
        return hc_put_back(y, x, post, comb)

    def route(self, i: int, logits: np.ndarray) -> Routing:
        """sqrt-softplus scores; the hash table's or the biased top-k's experts; weights the
        chosen scores, normalized (transformers always; llama.cpp by expert_weights_norm) and scaled."""
        L, s = self.layers[i], self.spec
        scores = np.sqrt(np.logaddexp(np.float32(0), logits)).astype(np.float32)  # [T, E]
        if "tid2eid" in L:
            ids = L["tid2eid"][self._tokens]  # [T, K]
        else:
            ids = top_k_ids(scores + L["bias"], self.top_k)
        w = np.take_along_axis(scores, ids, axis=1)
        if s.expert_weights_norm:
            w = w / w.sum(axis=1, keepdims=True)
        return Routing(ids.astype(np.int64), (w * np.float32(s.expert_weights_scale)).astype(np.float32))

    def clamped_swiglu(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        lim = np.float32(self.v4.swiglu_limit)
        if lim > 0:
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        return swiglu(g, u)

    def expert(self, e: Expert, x: np.ndarray) -> np.ndarray:
        return e.down(self.clamped_swiglu(*e.gate_and_up(x)))

    # -- attention -----------------------------------------------------------------------
    def attention(self, i: int, n: np.ndarray, cache: KVCache, start: int, positions: np.ndarray) -> np.ndarray:
        s, L, v4, eps = self.spec, self.layers[i], self.v4, self.spec.rms_eps
        t, heads, d = n.shape[0], s.n_head, v4.head_dim
        ratio = v4.compress_ratios[i]
        inv = self.inv_comp if ratio else self.inv_main
        cos, sin = angles(inv, positions)
        qr = rms_norm(L["q_a"](n), L["q_a_norm"], eps)  # [T, q_lora]
        q = rotate_tail(rms_norm(L["q_b"](qr).reshape(t, heads, d), None, eps), cos, sin)  # [T, H, d]
        kv = rotate_tail(rms_norm(L["kv"](n), L["kv_norm"], eps)[:, None], cos, sin)  # [T, 1, d]
        rows = self.compressor_rows(L, n, ratio)  # [T, state]
        o = per_sequence(cache, start, lambda c, s, *r: self.attend_sequence(i, c, s, *r), q, kv, rows, qr, n, positions)
        o = rotate_tail(o, cos, -sin)  # the values' rotation undone at the query's position
        groups = o.reshape(t, v4.o_groups, -1)  # [T, G, H·d/G]
        return L["o_b"](np.concatenate([L["o_a"][g](np.ascontiguousarray(groups[:, g])) for g in range(v4.o_groups)], axis=-1))

    def attend_sequence(
        self,
        i: int,
        cache: KVCache,
        start: int,
        q: np.ndarray,
        kv: np.ndarray,
        rows: np.ndarray,
        qr: np.ndarray,
        n: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray:
        """One sequence's rows at positions start.., their kv [T, 1, d] and compressor rows
        [T, state], in blocks of the cache's prompt block: a block's keys and rows stored, the
        windows it completes folded into entries, then its queries q [T, H, d] over the raw
        window and the entries → [T, H, d]. The rings hold the window's keys and the rows a fold
        reads before a block, and the block itself (kv_rows), so nothing a block reads is gone."""
        t, step = q.shape[0], cache.prompt_block
        out = []
        for a in range(0, t, step):
            b = min(t, a + step)
            cache.store(i, kv[a:b], rows[a:b, None], at=start + a)
            self.fold_completed(i, cache, start + a, start + b)
            out.append(self.attend_block(i, cache, start + a, q[a:b], qr[a:b], n[a:b], positions[a:b]))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def attend_block(
        self, i: int, cache: KVCache, start: int, q: np.ndarray, qr: np.ndarray, n: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """Queries q [T, H, d] at positions start.. (their keys stored, their windows folded)
        over their raw window and the entries each sees → [T, H, d]."""
        end = start + q.shape[0]
        lo = max(0, start - self.v4.window + 1)
        raw = cache.keys(i, lo, end)[0]  # [N, d]
        entries, seen = self.entries(i, cache, qr, n, positions, end)
        return attend_with_entries(q, raw, lo, entries, seen, positions, self.v4.window, self.scale, self.layers[i]["sinks"])

    def compressor_rows(self, L: dict, n: np.ndarray, ratio: int) -> np.ndarray:
        """What the cache keeps per position for the compressors: [T, state] (0 wide on a sliding layer)."""
        if not ratio:
            return np.empty((n.shape[0], 0), np.float32)
        parts = [L["comp"]["kv"](n), L["comp"]["gate"](n)]
        if ratio == CSA_RATIO:
            parts += [L["idx"]["kv"](n), L["idx"]["gate"](n)]
        return np.concatenate(parts, axis=-1).astype(np.float32)

    def fold_completed(self, i: int, cache: KVCache, lo: int, hi: int) -> None:
        """Fold the windows positions lo..hi-1 complete (those whose last position is among them)
        into layer i's entries, each once, from the compressor rows its ring holds: the entry
        (and on a CSA layer the indexer's key beside it), rotated to its window's first position."""
        v4, L, eps = self.v4, self.layers[i], self.spec.rms_eps
        ratio = v4.compress_ratios[i]
        m0, m1 = (lo // ratio, hi // ratio) if ratio else (0, 0)
        if m1 == m0:
            return
        csa = ratio == CSA_RATIO
        first = (m0 - 1 if csa else m0) * ratio  # a CSA entry reads the window before its own too
        rows = cache.values(i, max(0, first), m1 * ratio)[0]  # [windows·ratio, state]
        cw, iw = v4.comp_width(i), v4.index_head_dim
        if first < 0:  # entry 0 of a CSA layer: nothing before window 0
            rows = np.concatenate([np.concatenate([no_window(ratio, 2 * cw), no_window(ratio, 4 * iw)], axis=1), rows])
        c = L["comp"]
        entries = fold_entries(rows[:, :cw], rows[:, cw : 2 * cw], c["ape"], c["norm"], ratio, csa, eps)
        cos, sin = angles(self.inv_comp, np.arange(m0, m1) * ratio)
        parts = [rotate_tail(entries[:, None], cos, sin)[:, 0]]  # [M', d]
        if csa:
            ix = L["idx"]
            keys = fold_entries(rows[:, 2 * cw : 2 * cw + 2 * iw], rows[:, 2 * cw + 2 * iw :], ix["ape"], ix["norm"], ratio, True, eps)
            parts.append(rotate_tail(keys[:, None], cos, sin)[:, 0])  # [M', iw]
        cache.entries_of(i).write(m0, np.concatenate(parts, axis=-1))

    def entries(
        self, i: int, cache: KVCache, qr: np.ndarray, n: np.ndarray, positions: np.ndarray, end: int
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """The layer's compressed entries [M, d] (every window complete by `end`, as stored) and,
        per query, the indices of those it sees: the ones complete by its position (HCA), of
        them the indexer's top k (CSA)."""
        v4, L = self.v4, self.layers[i]
        ratio, d, t = v4.compress_ratios[i], v4.head_dim, n.shape[0]
        m = end // ratio if ratio else 0
        if m == 0:
            return np.zeros((0, d), np.float32), [np.zeros(0, np.int64)] * t
        stored = cache.entries_of(i).read(0, m)  # [M, d (+ iw)]
        entries = stored[:, :d]
        visible = [np.arange(min(m, (int(p) + 1) // ratio)) for p in positions]  # complete by the query
        if ratio != CSA_RATIO:
            return entries, visible
        ih, iw = v4.index_heads, v4.index_head_dim
        keys = stored[:, d:]  # [M, iw]
        qcos, qsin = angles(self.inv_comp, positions)
        iq = rotate_tail(L["idx_q_b"](qr).reshape(t, ih, iw), qcos, qsin)  # [T, ih, iw]
        weights = L["idx_proj"](n) * np.float32(ih**-0.5)  # [T, ih]
        chosen = []
        for r, vis in enumerate(visible):  # row by row, as `attend_with_entries`
            per_head = np.maximum(iq[r] @ keys[vis].T, 0) * np.float32(iw**-0.5)  # [ih, M']
            chosen.append(vis[top_k_of(weights[r] @ per_head, v4.index_top_k)])
        return entries, chosen
