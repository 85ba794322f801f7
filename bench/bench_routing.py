"""Routing statistics of a made model next to the phone route traces'.

    python bench/bench_routing.py [--arch qwen3moe] [--preset qwen30b-shape] [--layers 8]
                                  [--model PATH] [--top-k K|model] [-n 128] [--streams text,greedy]
                                  [--fractions 0.1,0.2,0.3,0.45] [--traces DIR] [--trace-out DIR]
                                  [--logit-scale X] [--cross-layer] [--json]

Runs the model in this process (shared/model, every weight resident) on two
token streams, records its routing through `route_observer`, and measures
what makes routing realistic for an expert cache (docs/benchmarks.md,
"Synthetic routing"):

  1. LRU decode hit % at cache fractions f: f × n_layer × n_expert slabs,
     one global LRU, replayed by shared/analysis/replay.py exactly as the engine would;
  2. popularity per layer over the decode tokens: entropy of the picks
     (1 = uniform), the share of the picks taken by the top tenth of the
     experts and by the top one, the share of experts picked at all;
  3. temporal locality: P(an expert used at token t, same layer, is used
     again at t+1), within the next 4 and the next 16 tokens;

and, for reference, the mean gate weight of each token's first expert.

`--cross-layer` adds the cross-layer probe (what next-layer prefetch can
hope for): on the decode tokens, for each layer i and distance d = 0..3,
layer i+d's router applied to the input layer i's router saw (observed with
ModelOptions.router_input_observer); its top-k against the top-k layer i+d
then chose. Expert accuracy = share of layer i+d's chosen experts found in the
guess; set accuracy = share of tokens whose guess is the whole set. d = 0 is
the control (100 %).

Streams: `text` prefills a prompt of corpus text (shared/data/corpus.txt)
and then decodes the text that follows it, one forced token at a time: the
token diversity of real text. `greedy` prefills the same prompt and decodes
the model's own argmax, as the benchmarks do.

The traces' rows are cut to the same number of decode tokens as ours
(popularity depends on how many tokens it is counted over; gptoss.route.csv
has 64). `--top-k` defaults to the trace's k for the arch (qwen3moe 6,
gpt-oss 2; they were recorded with fewer experts than the models' 8 and 4),
`model` uses the model's own. The model is made on first use under
bench/out/, named after the preset and the router shape so a changed
router makes a new file; qwen30b-shape cut to 8 layers is 3.3 GB (~20 s),
gptoss120b-shape cut to 4 is 8.1 GB (~40 s). 128 tokens of each stream take
5 s at 8 layers, 20 s at 48.

`--logit-scale X` multiplies the routers' logits in memory: the scan that
calibrated qwen3moe's router (its logit spread: shared/families/qwen3moe/plan.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TRACES = {"qwen": "qwen3moe", "gptoss": "gpt-oss"}  # trace file stem -> arch it was recorded on
FRACTIONS = (0.1, 0.2, 0.3, 0.45)
PROMPT_TOKENS = 32
CORPUS_START = 20000  # characters into the corpus: mid-text, away from the title lines


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class RoutingStats:
    decode_tokens: int
    top_k: int
    lru_hit_pct: dict  # fraction -> LRU hit % decode
    entropy: float  # mean over layers of H(picks) / log(n_expert)
    top_tenth_share: float  # mean over layers: share of picks taken by the top 10 % of experts
    top1_share: float
    used: float  # share of (layer, expert) picked at least once in decode
    reuse: dict  # window -> P(used again within `window` tokens | used at t)
    per_layer_top_tenth: tuple  # (min, max) over layers
    per_layer_reuse1: tuple
    top_gate_weight: float  # mean gate weight of each decoded token's first expert

    def row(self) -> dict:
        return {k: (v if not isinstance(v, float) else round(v, 4)) for k, v in self.__dict__.items()}


def head(trace, n_decode: int):
    """The trace's prompt and its first `n_decode` decoded tokens (first turn only)."""
    from moe_pipe.shared.model.trace import DECODE, Trace

    turn0 = trace.turn == trace.turn.min()
    dec = turn0 & (trace.phase == DECODE)
    steps = np.unique(trace.step[dec])
    keep = turn0 & ((trace.phase != DECODE) | np.isin(trace.step, steps[:n_decode]))
    cols = {c: trace.column(c)[keep] for c in ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")}
    return Trace(trace.path, trace.header, **cols, first_row_line=trace.first_row_line)


def decode_sets(trace) -> np.ndarray:
    """bool [T, L, E]: which experts each decoded token used at each layer."""
    from moe_pipe.shared.model.trace import DECODE

    h = trace.header
    dec = trace.phase == DECODE
    steps = np.unique(trace.step[dec])
    used = np.zeros((len(steps), h.n_layer, h.n_expert), bool)
    used[np.searchsorted(steps, trace.step[dec]), trace.layer[dec], trace.expert[dec]] = True
    return used


def lru_hit_pct(trace, fraction: float) -> float:
    """LRU decode hit % with fraction × n_layer × n_expert slabs (at least one token's top-k)."""
    from moe_pipe.shared.analysis.replay import MIB, Replayer, slab_bytes

    h = trace.header
    n = max(h.n_expert_used, int(round(fraction * h.n_layer * h.n_expert)))
    slab = slab_bytes(trace)
    return Replayer(trace).run((n * slab + slab // 2) / MIB, "lru").hit_pct_decode


def routing_stats(trace, fractions=FRACTIONS) -> RoutingStats:
    from moe_pipe.shared.model.trace import DECODE

    used = decode_sets(trace)  # [T, L, E]
    n_tok, _, n_exp = used.shape
    picks = used.sum(0).astype(np.float64)  # [L, E]
    p = picks / np.maximum(picks.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log(p), 0.0).sum(1) / np.log(n_exp)  # [L]
    ranked = -np.sort(-p, axis=1)
    top_tenth = ranked[:, : max(1, n_exp // 10)].sum(1)  # [L]
    reuse, reuse1_layer = {}, None
    for w in (1, 4, 16):
        again = np.zeros(used.shape[1])
        for t in range(n_tok - w):
            again += (used[t] & used[t + 1 : t + 1 + w].any(0)).sum(1)
        base = used[: n_tok - w].sum((0, 2))
        reuse[w] = float(again.sum() / max(1, base.sum()))
        if w == 1:
            reuse1_layer = again / np.maximum(base, 1)
    return RoutingStats(
        decode_tokens=n_tok,
        top_k=trace.header.n_expert_used,
        lru_hit_pct={f: lru_hit_pct(trace, f) for f in fractions},
        entropy=float(entropy.mean()),
        top_tenth_share=float(top_tenth.mean()),
        top1_share=float(ranked[:, 0].mean()),
        used=float((picks > 0).mean()),
        reuse=reuse,
        per_layer_top_tenth=(float(top_tenth.min()), float(top_tenth.max())),
        per_layer_reuse1=(float(reuse1_layer.min()), float(reuse1_layer.max())),
        top_gate_weight=float(trace.weight[(trace.phase == DECODE) & (trace.slot == 0)].mean()),  # slot 0: each token's first choice
    )


# ---------------------------------------------------------------- our model


class Recorder:
    """A route_observer that keeps every routing as trace rows (the phone traces' order:
    a prompt batch layer by layer, then each decoded token layer by layer)."""

    def __init__(self, n_layer: int):
        self.n_layer, self.phase, self.step, self.rows = n_layer, 0, 0, []
        self.inputs: list[tuple[int, np.ndarray]] = []  # (layer, router input [1, D]) of each decoded token

    def saw_input(self, layer: int, x) -> None:
        if self.phase == 1:
            self.inputs.append((layer, x.copy()))

    def __call__(self, layer: int, routing) -> None:
        ids, w = routing.ids, routing.weights  # [T, K]
        self.rows.append((self.phase, self.step, layer, ids.copy(), w.copy()))
        if layer == self.n_layer - 1:
            self.step += ids.shape[0]

    def trace(self, header):
        from moe_pipe.shared.model.trace import Trace

        cols = {c: [] for c in ("phase", "step", "layer", "slot", "expert", "weight")}
        for phase, step, layer, ids, w in self.rows:
            t, k = ids.shape
            cols["phase"].append(np.full(t * k, phase))
            cols["step"].append(np.repeat(np.arange(step, step + t), k))
            cols["layer"].append(np.full(t * k, layer))
            cols["slot"].append(np.tile(np.arange(k), t))
            cols["expert"].append(ids.reshape(-1))
            cols["weight"].append(w.reshape(-1).astype(np.float64))
        c = {k: np.concatenate(v) for k, v in cols.items()}
        n = c["phase"].size
        c = {k: (v if k == "weight" else v.astype(np.int64)) for k, v in c.items()}
        nbytes = np.asarray(header.expert_bytes, np.int64)[c["layer"]]
        return Trace("ours", header, turn=np.zeros(n, np.int64), residency=np.zeros(n, np.int64), expert_bytes=nbytes, **c)


def corpus_tokens(tok, n: int) -> list[int]:
    from moe_pipe.shared.gguf.vocab import DATA_DIR
    from moe_pipe.shared.text.chat import encode_prompt

    text = (DATA_DIR / "corpus.txt").read_text(encoding="utf-8")
    ids = encode_prompt(tok, text[CORPUS_START:] + text[:CORPUS_START])  # wrap round: always n tokens
    if len(ids) < n:
        raise SystemExit(f"bench_routing: the corpus is only {len(ids)} tokens, fewer than {n}")
    return ids[:n]


class RoutesTo:
    """The model's one route observer (fixed at load), handing each routing to
    the recorder of the stream being run, or to nobody between streams."""

    def __init__(self):
        self.recorder: Recorder | None = None

    def __call__(self, layer, routing) -> None:
        if self.recorder is not None:
            self.recorder(layer, routing)

    def saw_input(self, layer, x) -> None:
        if self.recorder is not None:
            self.recorder.saw_input(layer, x)


def run_stream(model, routes: RoutesTo, tok, header, stream: str, n: int):
    """One prompt + n decoded tokens; returns (trace, distinct decoded tokens, recorder)."""
    ids = corpus_tokens(tok, PROMPT_TOKENS + n)
    rec = Recorder(model.spec.n_layer)
    routes.recorder = rec
    try:
        cache = model.new_cache(PROMPT_TOKENS + n + 8)
        logits = model.prefill(ids[:PROMPT_TOKENS], cache, batch=PROMPT_TOKENS)  # one batch, like the phone traces
        rec.phase = 1
        out = []
        for j in range(n):
            token = ids[PROMPT_TOKENS + j] if stream == "text" else int(np.argmax(logits))
            out.append(token)
            logits = model.decode_one(token, cache)
    finally:
        routes.recorder = None
    return rec.trace(header), len(set(out)), rec


# ---------------------------------------------------------------- cross-layer probe

MAX_DISTANCE = 3


@dataclass(frozen=True)
class CrossLayer:
    """Layer i+d's router on layer i's router input, against what layer i+d chose."""

    expert: dict  # d -> (per-layer expert accuracy over i, overall)
    whole: dict  # d -> (per-layer whole-set accuracy over i, overall)

    def row(self) -> dict:
        def r(x):
            return [round(v, 4) for v in x[0]], round(x[1], 4)

        return {"expert": {d: r(v) for d, v in self.expert.items()}, "whole_set": {d: r(v) for d, v in self.whole.items()}}


def cross_layer(model, rec: Recorder, max_d: int = MAX_DISTANCE) -> CrossLayer:
    """The probe over a stream's decode tokens (docstring at the top)."""
    from moe_pipe.shared.model.moe import top_k_ids

    n_layer, k = model.spec.n_layer, model.top_k
    chosen = {layer: np.concatenate([ids for ph, _, l, ids, _ in rec.rows if ph == 1 and l == layer]) for layer in range(n_layer)}
    seen = {layer: np.concatenate([x for l, x in rec.inputs if l == layer]) for layer in range(n_layer)}  # [T, D]
    expert, whole = {}, {}
    for d in range(max_d + 1):
        s_rows, w_rows = [], []
        for i in range(n_layer - d):
            guess = top_k_ids(model.router_logits(i + d, seen[i]), k)  # [T, K]
            actual = chosen[i + d]
            found = (guess[:, :, None] == actual[:, None, :]).any(1)  # [T, K]: the token's k-th choice found in the guess
            s_rows.append(found.mean(1))
            w_rows.append(found.all(1))
        if s_rows:
            expert[d] = ([float(r.mean()) for r in s_rows], float(np.concatenate(s_rows).mean()))
            whole[d] = ([float(r.mean()) for r in w_rows], float(np.concatenate(w_rows).mean()))
    return CrossLayer(expert, whole)


def cross_table(probes: dict[str, CrossLayer]) -> str:
    """Per stream: expert % / whole-set % by source layer i and distance d."""
    lines = []
    for name, p in probes.items():
        ds = list(p.expert)
        n = len(p.expert[0][0])
        lines.append(f"cross-layer probe, {name}: router of layer i+d on layer i's router input, expert % / whole-set %")
        lines.append("layer i  " + "  ".join(f"{f'd={d}':>11}" for d in ds))
        for i in range(n):
            cells = [f"{p.expert[d][0][i] * 100:5.1f}/{p.whole[d][0][i] * 100:5.1f}" if i < len(p.expert[d][0]) else "" for d in ds]
            lines.append(f"{i:>7}  " + "  ".join(f"{c:>11}" for c in cells))
        lines.append("overall  " + "  ".join(f"{f'{p.expert[d][1] * 100:5.1f}/{p.whole[d][1] * 100:5.1f}':>11}" for d in ds))
    return "\n".join(lines)


def scale_routers(model, factor: float) -> None:
    """Router logits × factor: top-k ids of a layer stay, its gate weights sharpen or soften."""
    f = np.float32(factor)
    for layer in model.layers:
        router = layer["router"]
        layer["router"] = lambda x, router=router: router(x) * f
        if "router_b" in layer:
            layer["router_b"] = layer["router_b"] * f


def model_path(args) -> Path:
    if args.model:
        return Path(args.model)
    from moe_pipe.shared.makemodel.maker import make_model
    from moe_pipe.shared.makemodel.plans import plan_part

    # The router shape in the name: a file made before a calibration change is not reused.
    tag = hashlib.blake2b(repr(plan_part(args.arch).router).encode(), digest_size=3).hexdigest()
    path = OUT / f"routing-{args.arch}-{args.preset}-L{args.layers}-{tag}.gguf"
    if not path.exists():
        print(f"making {path} ...", file=sys.stderr)
        make_model(args.arch, args.preset, path, layers=args.layers)
    return path


# ---------------------------------------------------------------- report


def _fmt_pair(x: tuple) -> str:
    return f"{x[0]:.2f}–{x[1]:.2f}"


def table(columns: dict[str, RoutingStats], fractions) -> str:
    names = list(columns)
    rows = [("decode tokens", [str(s.decode_tokens) for s in columns.values()]), ("top-k", [str(s.top_k) for s in columns.values()])]
    rows += [(f"LRU hit % @ {f:.0%} cache", [f"{s.lru_hit_pct[f]:.1f}" for s in columns.values()]) for f in fractions]
    rows += [
        ("entropy of picks (1 = uniform)", [f"{s.entropy:.3f}" for s in columns.values()]),
        ("share of top 10 % experts", [f"{s.top_tenth_share:.3f}" for s in columns.values()]),
        ("  per layer", [_fmt_pair(s.per_layer_top_tenth) for s in columns.values()]),
        ("share of top expert", [f"{s.top1_share:.3f}" for s in columns.values()]),
        ("experts picked at all", [f"{s.used:.2f}" for s in columns.values()]),
        ("P(reuse at t+1)", [f"{s.reuse[1]:.3f}" for s in columns.values()]),
        ("  per layer", [_fmt_pair(s.per_layer_reuse1) for s in columns.values()]),
        ("P(reuse within 4)", [f"{s.reuse[4]:.3f}" for s in columns.values()]),
        ("P(reuse within 16)", [f"{s.reuse[16]:.3f}" for s in columns.values()]),
        ("gate weight of the first expert", [f"{s.top_gate_weight:.3f}" for s in columns.values()]),
    ]
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    lines = ["  ".join([" " * w0, *(n.rjust(w) for n, w in zip(names, widths))])]
    lines += ["  ".join([label.ljust(w0), *(c.rjust(w) for c, w in zip(cells, widths))]) for label, cells in rows]
    return "\n".join(lines)


def traces_dir(arg: str | None) -> Path:
    for d in (arg, os.environ.get("MOE_PIPE_ROUTE_TRACES"), ROOT.parent / "shared" / "data" / "route-traces"):
        if d and all((Path(d) / f"{n}.route.csv").is_file() for n in TRACES):
            return Path(d)
    sys.exit("bench_routing: no route traces found: pass --traces DIR or set MOE_PIPE_ROUTE_TRACES")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3moe", choices=("qwen3moe", "gpt-oss", "gemma4"))
    ap.add_argument("--preset", default=None, help="default: the arch's full-width shape preset")
    ap.add_argument(
        "--layers", type=int, default=None, help="cut the preset to this many layers (default: 8 for a shape preset, else the preset's own)"
    )
    ap.add_argument("--model", help="measure this GGUF instead of making one")
    ap.add_argument("--top-k", default=None, help="experts per token: a number, or `model` (default: the arch's trace k)")
    ap.add_argument("-n", type=int, default=128, help="decoded tokens per stream (default 128)")
    ap.add_argument("--streams", default="text,greedy", help="text, greedy or both (default)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="cache fractions for the LRU replay")
    ap.add_argument("--traces", help="directory of qwen.route.csv and gptoss.route.csv")
    ap.add_argument("--trace-out", help="also write our route traces here (replay them with `moe-pipe replay`)")
    ap.add_argument(
        "--logit-scale",
        type=float,
        default=1.0,
        help="multiply every router's logits (weights and bias) by this, in memory: the calibration scan",
    )
    ap.add_argument("--cross-layer", action="store_true", help="also run the cross-layer probe (next-layer prefetch's accuracy)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    streams = [s for s in args.streams.split(",") if s]
    if any(s not in ("text", "greedy") for s in streams):
        ap.error("--streams takes text and/or greedy")

    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.plans import SHAPE_PRESET_ARCH, get_preset
    from moe_pipe.shared.model.load import ModelOptions, load_model
    from moe_pipe.shared.model.trace import TraceHeader, read_trace, write_trace
    from moe_pipe.shared.text.tokenizer import Tokenizer

    if args.preset is None:
        args.preset = next(p for p, a in SHAPE_PRESET_ARCH.items() if a == args.arch)
    if args.layers is None:
        args.layers = 8 if args.preset in SHAPE_PRESET_ARCH else get_preset(args.arch, args.preset).n_layer
    tdir = traces_dir(args.traces)
    phone = {name: read_trace(tdir / f"{name}.route.csv") for name in TRACES}
    path = model_path(args)
    with open_model(path) as mf:
        arch = mf.spec.arch
        if args.top_k in (None, ""):
            top_k = next((t.header.n_expert_used for n, t in phone.items() if TRACES[n] == arch), None)
        else:
            top_k = None if args.top_k == "model" else int(args.top_k)
        routes = RoutesTo()
        observe_inputs = routes.saw_input if args.cross_layer else None
        model = load_model(mf, top_k=top_k, options=ModelOptions(route_observer=routes, router_input_observer=observe_inputs))
        if args.logit_scale != 1.0:
            scale_routers(model, args.logit_scale)
        header = TraceHeader.from_layout(str(path), mf.layout, model.top_k)
        desc = f"{path.name}: {arch}, {mf.spec.n_layer} layers × {mf.spec.n_expert} experts, top-{model.top_k}"
        if args.logit_scale != 1.0:
            desc += f", router logits × {args.logit_scale:g}"
        tok = Tokenizer.from_gguf(mf.gguf)
        ours, distinct, probes = {}, {}, {}
        for s in streams:
            t0 = time.perf_counter()
            trace, distinct[s], rec = run_stream(model, routes, tok, header, s, args.n)
            if args.cross_layer:
                probes[f"ours ({s})"] = cross_layer(model, rec)
            print(f"  {s}: {args.n} tokens in {time.perf_counter() - t0:.0f} s, {distinct[s]} distinct", file=sys.stderr)
            if args.trace_out:
                Path(args.trace_out).mkdir(parents=True, exist_ok=True)
                write_trace(Path(args.trace_out) / f"{path.stem}-{s}.route.csv", trace)
            ours[s] = routing_stats(trace, fractions)
    cols = {f"ours ({s})": st for s, st in ours.items()}
    for name, t in phone.items():
        cols[f"{name} trace"] = routing_stats(head(t, args.n), fractions)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(path),
                    "arch": arch,
                    "top_k": model.top_k,
                    "distinct_tokens": distinct,
                    "stats": {k: v.row() for k, v in cols.items()},
                    "cross_layer": {k: v.row() for k, v in probes.items()},
                },
                indent=1,
            )
        )
    else:
        print(desc)
        print("decoded tokens distinct: " + ", ".join(f"{s} {d}/{args.n}" for s, d in distinct.items()))
        print(table(cols, fractions))
        if probes:
            print(cross_table(probes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
