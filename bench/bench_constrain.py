"""Constrained decoding overhead per token next to a decode token of the tiny model.

    python3 bench/bench_constrain.py [--libs llguidance,xgrammar] [--tokens 400] [--threads 1] [--qwen PATH]

Per vocabulary (the tiny model's 2,048 tokens; the qwen30b-shape vocabulary
of 151,936 tokens, from a sparse made GGUF unless --qwen names one), per
grammar (`json_object`, a small schema, a larger nested one) and per
library: the time to build the library's tokenizer, to compile the grammar,
and per token the work the Sampler adds (the library's allowed-token mask,
applying it to the logits, telling it the chosen token), as medians over
random walks through the grammar (each step takes the best of random
logits among the allowed tokens, until end-of-generation or 64 tokens).
Then, in the generation loop itself: per library, `--gens` sampled
generations (temperature 1) of the small schema on the tiny model, each
paired with an unconstrained one of the same seed and the same number of
forward passes, run back to back; the median of the paired per-token time
ratios is the overhead a constrained reply pays end to end.
The decode token is the tiny model's resident `decode_one` plus its
Sampler draw, median over 64 tokens, on `--threads` kernel threads (1 by
default: the tiny model's matrices are too small to share, so one thread is
its fastest decode and the strictest yardstick). Figures on a shared
machine are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "label": {"type": "string", "maxLength": 12},
    },
    "required": ["colour", "count", "label"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
GRAMMARS = {"json_object": {"type": "object"}, "small schema": SMALL, "nested schema": NESTED}
WALK_TOKENS = 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", default="llguidance,xgrammar", help="comma-separated: llguidance, xgrammar")
    ap.add_argument("--tokens", type=int, default=400, help="constrained tokens measured per grammar and library")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads for the tiny model's decode token")
    ap.add_argument("--gens", type=int, default=30, help="paired generations for the end-to-end figure")
    ap.add_argument("--qwen", type=Path, help="a qwen30b-shape GGUF (default: a sparse one made in a temporary folder)")
    args = ap.parse_args(argv)
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]

    from moe_pipe.shared import quant
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.makemodel.default_model import default_model_path
    from moe_pipe.shared.makemodel.maker import make_model
    from moe_pipe.shared.text.tokenizer import Tokenizer

    quant.set_threads(args.threads)
    tiny = default_model_path()
    decode_ms = _decode_token_ms(tiny)
    print(f"tiny model decode token (resident decode_one + Sampler, {args.threads} thread(s)): median {decode_ms:.3f} ms over 64 tokens")
    with tempfile.TemporaryDirectory(prefix="bench-constrain") as tmp:
        qwen = args.qwen or make_model("qwen3moe", "qwen30b-shape", Path(tmp) / "q.gguf", layers=1, sparse=True)
        for label, path in (("tiny", tiny), ("qwen30b-shape", qwen)):
            with open_model(path) as mf:
                tok = Tokenizer.from_gguf(mf.gguf)
            print(f"\nvocabulary {label}: {tok.n_vocab} tokens")
            print(
                f"  {'library':11s} {'grammar':14s} {'build ms':>9s} {'compile ms':>10s} {'µs/token':>9s} {'p90 µs':>8s} {'% of tiny decode':>16s}"
            )
            for lib in libs:
                t0 = time.perf_counter()
                engine = ENGINES[lib](tok)
                build_ms = (time.perf_counter() - t0) * 1e3
                for gname, schema in GRAMMARS.items():
                    t0 = time.perf_counter()
                    compiled = engine.compile(schema)
                    compile_ms = (time.perf_counter() - t0) * 1e3
                    per_token = _walks(engine, compiled, tok.n_vocab, args.tokens)
                    med = statistics.median(per_token)
                    p90 = statistics.quantiles(per_token, n=10)[-1]
                    print(
                        f"  {lib:11s} {gname:14s} {build_ms:9.1f} {compile_ms:10.2f} {med * 1e6:9.1f} {p90 * 1e6:8.1f} "
                        f"{100 * med * 1e3 / decode_ms:15.2f}%"
                    )
                    build_ms = 0.0  # the tokenizer is built once per process
    print(f"\nin the generation loop (tiny model, small schema, temperature 1, {args.gens} paired generations)")
    for lib in libs:
        ratio, n_tokens = _end_to_end(tiny, lib, args.gens)
        print(f"  {lib:11s} constrained / free per-token time: median {ratio:.3f} ({100 * (ratio - 1):+.1f} %), {n_tokens} tokens a reply")
    return 0


def _end_to_end(path: Path, lib: str, gens: int) -> tuple[float, float]:
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import load_model
    from moe_pipe.shared.text.generate import GenerationConfig, generate
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        model = load_model(mf)
        engine = ENGINES[lib](tok)
        compiled = engine.compile(SMALL)
        prompt = tok.encode("Pick a colour and answer in JSON:")
        generate(model, tok, prompt, SamplingParams(), GenerationConfig(max_tokens=16, n_ctx=512))  # warm-up
        ratios, lengths = [], []
        for seed in range(gens):
            params = SamplingParams(temperature=1.0, seed=seed)
            bound = _Bound(engine, engine.start(compiled))
            held = generate(model, tok, prompt, params, GenerationConfig(max_tokens=200, n_ctx=512), constraint=bound)
            n = len(held.tokens)  # n forward passes, ending with the draw of end-of-generation
            free = generate(model, tok, prompt, params, GenerationConfig(max_tokens=n + 1, n_ctx=512, ignore_eos=True))
            ratios.append(held.timings["predicted_ms"] / free.timings["predicted_ms"])
            lengths.append(n)
    return statistics.median(ratios), statistics.median(lengths)


class _Bound:
    """An engine's matcher as the Sampler's Constraint."""

    def __init__(self, engine, state):
        self.engine, self.state = engine, state

    def mask(self, z):
        self.engine.mask(self.state, z)

    def accept(self, token):
        self.engine.accept(self.state, token)


def _decode_token_ms(path: Path) -> float:
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import load_model
    from moe_pipe.shared.text.sampling import Sampler, SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    with open_model(path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        model = load_model(mf)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
        cache = model.new_cache(256)
        logits = model.prefill(tok.encode("The river runs"), cache)
        token = sampler(logits)
        for _ in range(8):  # warm-up: the kernels compile or load on first use
            logits = model.decode_one(token, cache)
            token = sampler(logits)
        times = []
        for _ in range(64):
            t0 = time.perf_counter()
            logits = model.decode_one(token, cache)
            token = sampler(logits)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _walks(engine, compiled, n_vocab: int, n_tokens: int) -> list[float]:
    """Per-token seconds of mask + apply + accept over random walks through the grammar."""
    rng = np.random.default_rng(0)
    times: list[float] = []
    state = engine.start(compiled)
    steps = 0
    while len(times) < n_tokens:
        z = rng.standard_normal(n_vocab)
        t0 = time.perf_counter()
        engine.mask(state, z)
        spent = time.perf_counter() - t0
        token = int(np.argmax(z))  # the draw itself is the Sampler's own cost, not the constraint's
        done = token in engine.eog or steps >= WALK_TOKENS
        if not done:
            t0 = time.perf_counter()
            engine.accept(state, token)
            spent += time.perf_counter() - t0
        times.append(spent)
        steps += 1
        if done:
            state, steps = engine.start(compiled), 0
    return times


class _Llguidance:
    def __init__(self, tok):
        from moe_pipe.shared.text.constrain import TokenAdapter

        self.adapter = TokenAdapter(tok)
        self.eog = set(self.adapter.eog_ids)

    def compile(self, schema):
        from moe_pipe.shared.text.constrain import compile_schema

        return compile_schema(schema)

    def start(self, grammar):
        return self.adapter.constraint(grammar)

    def mask(self, c, z):
        c.mask(z)

    def accept(self, c, token):
        c.accept(token)


class _Xgrammar:
    """xgrammar with the same vocabulary (special tokens as empty strings, which
    it never allows inside a grammar), compact JSON as llguidance is asked for,
    and the mask applied the same way (numpy unpack, -inf)."""

    def __init__(self, tok):
        import xgrammar as xgr

        from moe_pipe.shared.text.tokenizer import BYTE, NORMAL

        self.xgr = xgr
        self.n_vocab = tok.n_vocab
        self.eog = set(tok.eog_ids)
        vocab = [tok.token_bytes(i) if tok.token_type(i) in (NORMAL, BYTE) else b"" for i in range(tok.n_vocab)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bits = xgr.allocate_token_bitmask(1, tok.n_vocab)
        self.bits_np = self.bits.numpy()

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher, z):
        matcher.fill_next_token_bitmask(self.bits)
        bad = np.unpackbits(np.invert(self.bits_np[0].view(np.uint8)), count=self.n_vocab, bitorder="little").view(bool)
        np.putmask(z, bad, -np.inf)

    def accept(self, matcher, token):
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")


ENGINES = {"llguidance": _Llguidance, "xgrammar": _Xgrammar}

if __name__ == "__main__":
    sys.exit(main())
