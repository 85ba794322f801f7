"""`moe-pipe run [MODEL|CONFIG] -p PROMPT`: one generation through the streaming
pipeline (or, with --no-stream, every weight resident in this process).
`--session FILE` starts from a saved KV cache and saves the new one
(docs/conversations.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..shared.config import Config


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..shared.config_flags import add_override_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a GGUF file (any shard of a split set), a TOML config or a catalog name (moe-pipe models --catalog); "
        "default: the embedded tiny model",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="the prompt text; - reads it from stdin")
    source.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the chat template as a user turn (the model's own unless --chat-template says otherwise)",
    )
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one's probability")
    p.add_argument("--sample-top-k", metavar="K", help="deprecated: --top-k (goes in the next release)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recently used tokens (1 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens (benchmarks)")
    p.add_argument("--no-stream", action="store_true", help="hold every weight resident in this process (the reference path)")
    p.add_argument(
        "--session",
        metavar="FILE",
        help="start from the KV cache saved in FILE when it exists (only the prompt past the prefix they share is computed), "
        "and save prompt + output to FILE afterwards (llama.cpp's --prompt-cache)",
    )
    p.add_argument("--output-format", choices=("text", "json"), default="text")
    add_override_arguments(p, tables=("cache", "io", "compute", "generate", "telemetry"))


def load_run_config(args: argparse.Namespace) -> Config:
    from ..shared.config_flags import overrides_from_args
    from ..shared.hub.resolve import load_model_argument

    if getattr(args, "sample_top_k", None) is not None:  # run only
        print(
            "moe-pipe: --sample-top-k is now --top-k, sampling top-k as llama.cpp's (the old name goes in the next release)",
            file=sys.stderr,
        )
        if args.top_k is None:
            args.top_k = args.sample_top_k
    return load_model_argument(args.model, overrides_from_args(args))


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt: -p TEXT, -p - (stdin) or -f FILE."""
    from ..shared.errors import UserError

    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the prompt file {args.file}: {getattr(exc, 'strerror', None) or exc}") from None
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def _prompt_tokens(args, cfg: Config, tok, prompt: str) -> list[int]:
    from ..shared.text.chat import chat_prompt_tokens, encode_prompt, use_chat_template

    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        return chat_prompt_tokens(use_chat_template(tok, cfg.generate.chat_template), messages, no_think=cfg.generate.no_think)
    return encode_prompt(tok, prompt)


def _model_file(cfg: Config) -> Path:
    """The model's path; says where the embedded tiny model was made when this run made it."""
    from ..shared.config import EMBEDDED_MODEL
    from ..shared.hub.resolve import model_file
    from ..shared.makemodel.default_model import cache_dir

    if cfg.model.path != EMBEDDED_MODEL:
        return model_file(cfg)
    before = set(cache_dir().glob("*.gguf"))
    path = model_file(cfg)
    if path not in before:
        print(f"[made the embedded tiny model: {path}]", file=sys.stderr)
    return path


def kernel_text(step: int, total: int, item: str) -> str:
    return f"compiling kernels {step}/{total}: {item}"


def run(args: argparse.Namespace) -> int:
    import gc

    from ..shared.heap import give_back
    from ..shared.text.sampling import SamplingParams

    prompt = read_prompt(args)  # first: a missing file fails before anything starts
    cfg = load_run_config(args)
    model_path = _model_file(cfg)
    g = cfg.generate
    params = SamplingParams(
        temperature=g.temperature,
        top_k=g.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=g.seed,
    )
    tok = _read_tokenizer(model_path)
    prompt_tokens = _prompt_tokens(args, cfg, tok, prompt)
    streaming_text = args.output_format == "text"
    on_text = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if streaming_text else None
    if args.no_stream:
        out = _run_resident(cfg, model_path, tok, prompt_tokens, params, args, on_text)
    else:
        # Compute detokenizes; the tokenizer here (tens of MB for a 150k-262k vocab) would sit in
        # the memory the budget probes next, taken from the expert cache for the whole run.
        del tok
        gc.collect()
        give_back()
        out = _run_pipeline(cfg, model_path, prompt_tokens, params, args, on_text)
    if streaming_text:
        t = out["timings"]
        sys.stdout.write("\n")
        print(
            f"[{t['prompt_n']} prompt tokens{_cached(t)} at {t['prompt_tok_s']:.1f} tok/s, {t['predicted_n']} generated at "
            f"{t['predicted_tok_s']:.1f} tok/s{_steady(t)}{_drafts(t)}, finish: {out['finish_reason']}; "
            f"load {t['load_seconds']:.2f} s, kernels {t['compile_seconds']:.2f} s (not in the rates)]",
            file=sys.stderr,
        )
    else:
        print(json.dumps(out, ensure_ascii=False))
    return 0


def _read_tokenizer(model_path):
    """The model's tokenizer; the opened file, with the header it parsed, is gone on return."""
    from ..shared.gguf.model_file import open_model
    from ..shared.text.tokenizer import Tokenizer

    with open_model(model_path) as mf:
        return Tokenizer.from_gguf(mf.gguf)


def _steady(t: dict) -> str:
    """The last quarter's rate, the "steady" `doctor` forecasts and `bench` reports, when the reply has one."""
    return f" (steady {t['steady_tok_s']:.1f})" if t.get("steady_tok_s") and t.get("predicted_n", 0) >= 8 else ""


def _drafts(t: dict) -> str:
    """Speculative decoding's acceptance, when it drafted (docs/speculative.md)."""
    if "draft_n" not in t:
        return ""
    kept = f" ({t['draft_accepted'] / t['draft_n']:.0%})" if t["draft_n"] else ""
    return f", drafts {t['draft_accepted']} of {t['draft_n']} kept{kept} in {t['draft_passes']} verify passes"


def _cached(t: dict) -> str:
    return f" ({t['prompt_cached']} from the session)" if t.get("prompt_cached") else ""


def _run_resident(cfg: Config, model_path, tok, prompt_tokens, params, args, on_text) -> dict:
    import time

    from ..procs.warmup import CompileCounter, forward_pass, kernel_steps, warm_up
    from ..shared import quant
    from ..shared.cores import choose_threads
    from ..shared.errors import UserError
    from ..shared.experts.directio import model_identity
    from ..shared.gguf.model_file import open_model
    from ..shared.gguf.nextn import require_nextn
    from ..shared.gguf.spec import experts_per_token, lossy_expert_count
    from ..shared.model.load import ModelOptions, load_model
    from ..shared.model.session import save_session
    from ..shared.progress import StatusLine
    from ..shared.text.generate import GenerationConfig, generate
    from ..shared.text.speculate import drafter_for

    quant.one_blas_thread()
    try:
        quant.set_threads(choose_threads(cfg.compute.threads, most=quant.most_threads()).threads)
    except ValueError as exc:
        raise UserError(f"--threads: {exc}") from None
    gen_cfg = GenerationConfig(
        max_tokens=cfg.generate.max_tokens,
        stop=tuple(args.stop),
        n_ctx=cfg.compute.ctx_size,
        prefill_batch=cfg.compute.prefill_tokens,
        ignore_eos=args.ignore_eos,
        context_shift=cfg.generate.context_shift,
        n_keep=cfg.generate.n_keep,
        draft=cfg.compute.draft,
        draft_adapt=cfg.compute.draft_adapt,
    )
    from ..shared.model.levers import Levers
    from ..shared.model.routes import RouteReplay, RouteTracer
    from ..shared.model.trace import read_trace

    t0 = time.perf_counter()
    with open_model(model_path) as mf:
        experts_per_token(mf.spec, cfg.compute.n_expert_used)  # out of range: one line, before the load
        if cfg.compute.drafts_from_block:
            require_nextn(mf.spec)
        if lossy := lossy_expert_count(mf.spec, cfg.compute.n_expert_used):
            print(lossy, file=sys.stderr)
        replay = RouteReplay(read_trace(str(cfg.compute.route_replay)), mf.spec) if cfg.compute.route_replay else None
        tracer = RouteTracer(str(cfg.telemetry.route_trace), mf, cfg.compute.n_expert_used) if cfg.telemetry.route_trace else None
        if tracer:
            tracer.begin_turn()
        try:
            # Of the levers only route-ahead acts here: with every expert in memory nothing is a miss.
            levers = Levers(route_ahead=cfg.compute.route_ahead)
            options = ModelOptions(route_observer=tracer, route_replay=replay, kv_type=cfg.compute.kv_type, levers=levers)
            model = load_model(mf, top_k=cfg.compute.n_expert_used, options=options)
            session = _open_session(args.session, model, mf, gen_cfg.n_ctx)  # a refused file: before the kernels compile
            load_s = time.perf_counter() - t0
            with StatusLine() as status:
                status.update("loaded the model; compiling its kernels next")
                steps = kernel_steps(mf, forward_pass(mf, cfg.compute.n_expert_used, kv_type=cfg.compute.kv_type))
                warm = warm_up(steps, lambda i, n, item: status.update(kernel_text(i, n, item)))
                status.done(f"kernels ready in {warm.seconds:.2f} s ({warm.compiled} compiled, the rest from numba's cache)")
            with CompileCounter() as late:
                source = cfg.compute.draft_source if gen_cfg.draft else "none"
                drafter = drafter_for(
                    source, cfg.compute.draft_replay, mf.spec.n_vocab, model, session, gen_cfg.n_ctx, cfg.compute.draft_vocab
                )
                result = generate(
                    _Phases(model, tracer), tok, prompt_tokens, params, gen_cfg, on_text=on_text, session=session, drafter=drafter
                )
            if args.session:
                save_session(args.session, session, model_identity(mf.gguf.paths), model.arch)
        finally:
            if tracer:
                tracer.close()
    out = result.as_json()
    out["timings"] |= {"load_seconds": round(load_s, 3), "compile_seconds": round(warm.seconds, 3), "late_compiles": late.count}
    return out


def _open_session(path, model, mf, n_ctx):
    """The session of --session FILE: read when the file exists (refused with one
    line if it is another model's, truncated, ...), else a new one."""
    import os

    from ..shared.experts.directio import model_identity
    from ..shared.model.session import Session, load_session

    if path and os.path.exists(path):
        return load_session(path, model, n_ctx, model_identity(mf.gguf.paths))
    return Session()


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

    def drafts_judged(self, drafted: int, kept: int) -> None:
        self.model.drafts_judged(drafted, kept)

    def verify(self, tokens, cache, redo: int = 0):
        if self.tracer:
            self.tracer.phase = 1
        return self.model.verify(tokens, cache, redo)


def _run_pipeline(cfg: Config, model_path, prompt_tokens, params, args, on_text) -> dict:
    from dataclasses import asdict

    from ..procs.pipeline import start_pipeline
    from ..shared.progress import StatusLine

    pieces: list[str] = []

    def collect(text: str) -> None:
        pieces.append(text)
        if on_text:
            on_text(text)

    # Something at once: the dense load, compute's start and its kernels take a while on a
    # first run. The first line comes once the settings are checked, so a refusal stays one line.
    with StatusLine() as status:

        def show(p) -> None:
            if p.item:
                status.update(kernel_text(p.step, p.total, p.item))

        pipe = start_pipeline(cfg, model_path, on_progress=show, on_stage=status.update)
        status.done(f"kernels ready in {pipe.compile_seconds:.2f} s ({pipe.kernels_compiled} compiled, the rest from numba's cache)")
    with pipe:
        r = pipe.resolved
        print(
            f"[expert cache {r.n_slabs * r.slab_bytes / 2**20:.2f} MiB = {r.n_slabs} slabs of {r.slab_bytes / 2**20:.2f} MiB "
            f"({r.budget_description}); dense {cfg.io.dense_weights}, loaded in {r.load_seconds:.2f} s"
            f"{'' if r.direct_io else '; O_DIRECT refused, buffered reads'}]",
            file=sys.stderr,
        )
        session = str(Path(args.session).resolve()) if args.session else ""  # compute reads and writes it: an absolute path
        if session and Path(session).exists():
            pipe.slot("restore", session)
        done = pipe.generate(prompt_tokens, asdict(params), cfg.generate.max_tokens, tuple(args.stop), collect, args.ignore_eos)
        if session:
            pipe.slot("save", session)
    # One value per figure: the parent's load and budget, the same the CSV preamble and JSONL carry (docs/telemetry.md).
    timings = dict(done.timings) | {
        "load_seconds": r.load_seconds,
        "compile_seconds": pipe.compile_seconds,
        "budget_mib": round(r.n_slabs * r.slab_bytes / 2**20, 3),
    }
    return {
        "prompt_tokens": list(prompt_tokens),
        "tokens": list(done.tokens),
        "text": "".join(pieces),
        "finish_reason": done.finish_reason,
        "timings": timings,
    }
