"""`moe-pipe run [MODEL] -p PROMPT`: one generation, streamed to the terminal or as JSON."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="tiny",
                   help="GGUF file (or any shard of a split set); default: the embedded tiny model")
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--no-think", action="store_true", help="ask the model not to think (Qwen3 enable_thinking=false, gpt-oss reasoning low)")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the best one's probability")
    p.add_argument("--sample-top-k", type=int, default=0, help="sample among the K most likely tokens (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recently used tokens (1 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the model's own; fewer is faster and changes outputs)")
    p.add_argument("-t", "--threads", type=int, help="compute threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--no-stream", action="store_true",
                   help="hold every weight resident in one process (today the only mode; the streaming pipeline will become the default)")
    p.add_argument("--output-format", choices=("text", "json"), default="text")


def resolve_model(name: str):
    from pathlib import Path

    from moe_pipe.shared.default_model import DEFAULT_NAME, default_model_path
    from moe_pipe.shared.errors import UserError

    if name == DEFAULT_NAME:
        return default_model_path()
    path = Path(name)
    if path.suffix == ".toml":
        raise UserError(f"{name}: config files come with the streaming pipeline; pass a .gguf model for now")
    if not path.exists():
        raise UserError(f"{name}: no such model file; make one with `moe-pipe make-model --arch qwen3moe --preset tiny -o tiny.gguf` "
                        "or convert a checkpoint with `moe-pipe convert HF_DIR -o model.gguf`")
    return path


def run(args: argparse.Namespace) -> int:
    import time

    from moe_pipe.shared import quant
    from moe_pipe.shared.chat import render_chat
    from moe_pipe.shared.errors import UserError
    from moe_pipe.shared.generate import GenerationConfig, generate
    from moe_pipe.shared.model import load_model
    from moe_pipe.shared.model_file import open_model
    from moe_pipe.shared.sampling import SamplingParams
    from moe_pipe.shared.tokenizer import Tokenizer

    params = SamplingParams(temperature=args.temp, top_k=args.sample_top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, seed=args.seed)
    cfg = GenerationConfig(max_tokens=args.max_tokens, stop=tuple(args.stop), n_ctx=args.ctx_size)
    if args.threads is not None:
        try:
            quant.set_threads(args.threads)
        except ValueError as exc:
            raise UserError(f"--threads: {exc}") from None
    t0 = time.perf_counter()
    with open_model(resolve_model(args.model)) as mf:
        tok = Tokenizer.from_gguf(mf.gguf)
        model = load_model(mf, top_k=args.top_k)
        load_s = time.perf_counter() - t0
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
            text = render_chat(tok, messages, add_generation_prompt=True, no_think=args.no_think)
        else:
            text = args.prompt
        # A rendered template that writes BOS itself must not get a second one.
        starts_with_bos = tok.bos_id is not None and text.startswith(tok.token_text(tok.bos_id))
        prompt_tokens = tok.encode(text, add_bos=False if starts_with_bos else None, special=True)
        stream = args.output_format == "text"
        on_text = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if stream else None
        result = generate(model, tok, prompt_tokens, params, cfg, on_text=on_text)
    result.timings["load_s"] = round(load_s, 3)
    if stream:
        sys.stdout.write("\n")
        t = result.timings
        print(f"[{t['prompt_n']} prompt tokens at {t['prompt_tok_s']:.1f} tok/s, {t['predicted_n']} generated at "
              f"{t['predicted_tok_s']:.1f} tok/s, load {load_s:.2f} s, finish: {result.finish_reason}]", file=sys.stderr)
    else:
        print(json.dumps(result.as_json(), ensure_ascii=False))
    return 0
