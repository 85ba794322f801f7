"""`moe-pipe run [MODEL|CONFIG] -p PROMPT`: one generation through the streaming
pipeline (or, with --no-stream, every weight resident in this process)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moe_pipe.shared.config_flags import add_override_arguments

    p.add_argument(
        "model", nargs="?", default=None, help="a GGUF file (any shard of a split set) or a TOML config; default: the embedded tiny model"
    )
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the chat template as a user turn (the model's own unless --chat-template says otherwise)",
    )
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one's probability")
    p.add_argument("--sample-top-k", type=int, default=0, help="sample among the K most likely tokens (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recently used tokens (1 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens (benchmarks)")
    p.add_argument("--no-stream", action="store_true", help="hold every weight resident in this process (the reference path)")
    p.add_argument("--output-format", choices=("text", "json"), default="text")
    add_override_arguments(p, tables=("cache", "io", "compute", "generate", "telemetry"))


def load_run_config(args: argparse.Namespace):
    from pathlib import Path

    from moe_pipe.shared.config import check_model, load_config
    from moe_pipe.shared.config_flags import overrides_from_args

    overrides = overrides_from_args(args)
    if args.model and Path(args.model).suffix == ".toml":
        cfg = load_config(args.model, overrides)
    else:
        if args.model:
            overrides["model.path"] = args.model if args.model == "tiny" else str(Path(args.model).resolve())
        cfg = load_config(None, overrides)
    check_model(cfg)
    return cfg


def _prompt_tokens(args, cfg, tok) -> list[int]:
    from moe_pipe.shared.text.chat import chat_prompt_tokens, encode_prompt, use_chat_template

    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
        return chat_prompt_tokens(use_chat_template(tok, cfg.generate.chat_template), messages, no_think=cfg.generate.no_think)
    return encode_prompt(tok, args.prompt)


def run(args: argparse.Namespace) -> int:
    import time

    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.text.sampling import SamplingParams
    from moe_pipe.shared.text.tokenizer import Tokenizer

    cfg = load_run_config(args)
    model_path = cfg.model_file()
    g = cfg.generate
    params = SamplingParams(
        temperature=g.temperature,
        top_k=args.sample_top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=g.seed,
    )
    with open_model(model_path) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
    prompt_tokens = _prompt_tokens(args, cfg, tok)
    streaming_text = args.output_format == "text"
    on_text = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if streaming_text else None
    t0 = time.perf_counter()
    if args.no_stream:
        out = _run_resident(cfg, model_path, tok, prompt_tokens, params, args, on_text)
    else:
        out = _run_pipeline(cfg, model_path, prompt_tokens, params, args, on_text)
    out["timings"].setdefault(
        "load_s",
        round(time.perf_counter() - t0 - out["timings"].get("prompt_ms", 0) / 1e3 - out["timings"].get("predicted_ms", 0) / 1e3, 3),
    )
    if streaming_text:
        t = out["timings"]
        sys.stdout.write("\n")
        print(
            f"[{t['prompt_n']} prompt tokens at {t['prompt_tok_s']:.1f} tok/s, {t['predicted_n']} generated at "
            f"{t['predicted_tok_s']:.1f} tok/s, finish: {out['finish_reason']}]",
            file=sys.stderr,
        )
    else:
        print(json.dumps(out, ensure_ascii=False))
    return 0


def _run_resident(cfg, model_path, tok, prompt_tokens, params, args, on_text) -> dict:
    from moe_pipe.shared import quant
    from moe_pipe.shared.errors import UserError
    from moe_pipe.shared.gguf.model_file import open_model
    from moe_pipe.shared.model.load import ModelOptions, load_model
    from moe_pipe.shared.text.generate import GenerationConfig, generate

    quant.one_blas_thread()
    if cfg.compute.threads:
        try:
            quant.set_threads(cfg.compute.threads)
        except ValueError as exc:
            raise UserError(f"--threads: {exc}") from None
    gen_cfg = GenerationConfig(
        max_tokens=cfg.generate.max_tokens, stop=tuple(args.stop), n_ctx=cfg.compute.ctx_size, ignore_eos=args.ignore_eos
    )
    from moe_pipe.shared.model.routes import RouteReplay, RouteTracer
    from moe_pipe.shared.model.trace import read_trace

    with open_model(model_path) as mf:
        replay = RouteReplay(read_trace(str(cfg.compute.route_replay)), mf.spec) if cfg.compute.route_replay else None
        tracer = RouteTracer(str(cfg.telemetry.route_trace), mf, cfg.compute.top_k) if cfg.telemetry.route_trace else None
        if tracer:
            tracer.begin_turn()
        try:
            options = ModelOptions(route_observer=tracer, route_replay=replay, kv_type=cfg.compute.kv_type)
            model = load_model(mf, top_k=cfg.compute.top_k, options=options)
            result = generate(_Phases(model, tracer), tok, prompt_tokens, params, gen_cfg, on_text=on_text)
        finally:
            if tracer:
                tracer.close()
    return result.as_json()


class _Phases:
    """The model, telling a route tracer whether it is in the prompt or decoding."""

    def __init__(self, model, tracer):
        self.model, self.tracer = model, tracer

    def new_cache(self, n_ctx):
        return self.model.new_cache(n_ctx)

    def prefill(self, tokens, cache, batch=64):
        if self.tracer:
            self.tracer.phase = 0
        return self.model.prefill(tokens, cache, batch=batch)

    def decode_one(self, token, cache):
        if self.tracer:
            self.tracer.phase = 1
        return self.model.decode_one(token, cache)


def _run_pipeline(cfg, model_path, prompt_tokens, params, args, on_text) -> dict:
    from dataclasses import asdict

    from moe_pipe.procs.pipeline import start_pipeline

    pieces: list[str] = []

    def collect(text: str) -> None:
        pieces.append(text)
        if on_text:
            on_text(text)

    with start_pipeline(cfg, model_path) as pipe:
        r = pipe.resolved
        print(
            f"[expert cache {r.n_slots * r.slab_bytes / 2**20:.2f} MiB = {r.n_slots} slabs of {r.slab_bytes / 2**20:.2f} MiB; "
            f"{r.budget_description}; dense {cfg.io.dense_weights}, loaded in {r.load_seconds:.2f} s"
            f"{'' if r.direct_io else '; O_DIRECT refused, buffered reads'}]",
            file=sys.stderr,
        )
        done = pipe.generate(prompt_tokens, asdict(params), cfg.generate.max_tokens, tuple(args.stop), collect, args.ignore_eos)
    timings = dict(done.timings) | {"budget_mib": round(r.n_slots * r.slab_bytes / 2**20, 3)}
    return {
        "prompt_tokens": list(prompt_tokens),
        "tokens": list(done.tokens),
        "text": "".join(pieces),
        "finish_reason": done.finish_reason,
        "timings": timings,
    }
