"""Configuration: TOML presets → frozen dataclasses, with command-line overrides.

The schema is declared once, in the dataclasses below: every field carries a
`Spec` (kind, range or allowed values, doc, CLI flags) in its metadata, and
everything else — validation, the argparse flags, the docs table in
docs/configuration.md, the error messages — is derived from those fields.

    load_config(path, overrides)  -> Config          file + overrides, validated
    apply_overrides(cfg, mapping) -> Config          a new frozen Config
    check_chat_template(cfg)                          the template file is there (start-up)
    check_kv_pool(cfg)                                the slots' KV pool holds a whole context (start-up)
    SCHEMA                                            every key, in table order

Its flags and docs tables are shared/config_flags.py; which model file a
config names (the catalog's pulled file, the embedded tiny model) is
shared/hub/resolve.py. This module imports nothing of the project but its
errors, so every layer may read the typed config.

Config is never edited after start-up (docs/configuration.md § Rules): runtime facts (the
resolved budget, the model's own n_expert_used) travel back in messages and records.
Paths in a file are resolved against that file's folder; paths typed on the
command line against the current directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

EMBEDDED_MODEL = "tiny"  # model.path value meaning the embedded tiny model (shared/makemodel/default_model.py)
MAX_MB = float(1 << 24)  # 16 TiB in MiB: a sanity bound far above any device, so typos like 4e9 are caught
RESTART_POLICIES = ("always", "on-failure", "never")
# cache.policy values: the live eviction policies, each a factory in shared/experts/policies.py POLICIES
# (which adds the simulator-only ones). Measured (docs/cache-policies.md): on both phone traces at
# 2000-4000 MiB, in slabs and in bytes, nextmix beats nextuse by 0.04-0.9
# points of decode hit rate and lru by 1.9-7.8, and every other live policy.
LIVE_POLICIES = ("lru", "lfu", "arc", "s3fifo", "nextuse", "nextmix")
DEFAULT_POLICY = "nextmix"
# compute.prefill_chunk's default ceiling: a 3,600-token prompt (a document, an agent's tools) goes
# through in one chunk, each routed expert read once (docs/benchmarks.md § Long prompts); its
# activations, ~600 MiB on qwen30b-shape, are what it costs the expert cache.
AUTO_PREFILL_CHUNK = 4096
# Its ceiling with gateway.parallel above 1 (procs/slots.py): a step takes one prompt chunk beside the
# decoding slots' rows, so a long prompt holds each of their steps for one such chunk, not for all of it.
SLOT_PREFILL_CHUNK = 512
# gateway.kv_pool's auto size with gateway.parallel above 1: one whole context, and this fraction of one
# for each further slot. A household's or an agent's requests are mostly a few thousand tokens, so the
# slots rarely need a whole context each at once, and what they do not reserve goes to the expert cache.
KV_POOL_SHARE = 4
# compute.draft_source and compute.draft's bound (shared/text/speculate.py; kept light: no model import here)
DRAFT_SOURCES = ("ngram", "mtp", "none")
MAX_DRAFT = 8  # drafts per verify pass at most (docs/speculative.md: the gain measured is at 1-4)
MAX_PARALLEL = 64  # gateway.parallel's bound: compute's slots at most
KV_TYPES = ("f16", "f32", "q8_0")  # compute.kv_type: the keys of shared/gguf/spec.py KV_TYPE_BYTES (kept light: no gguf import here)
CHAT_TEMPLATE_WORDS = ("model", "plain")  # generate.chat_template values that are not paths (shared/text/chat.py)
MAX_TEXT = 4096  # longest string value (PATH_MAX on Linux); longer is a paste gone wrong
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # no key needs one; a newline would break one-line errors and CSV


@dataclass(frozen=True)
class Spec:
    """What a key accepts. kind: int | float | bool | str | path | choice | mb."""

    kind: str
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # the low bound is excluded (> rather than >=)
    choices: tuple[str, ...] = ()
    unset: str | None = None  # the key may be left out (None); this says what that means
    flags: tuple[str, ...] = ()
    allow_empty: bool = False  # for str/path: "" is a legal value
    words: tuple[str, ...] = ()  # for path: values that name no file ("tiny", "plain"), kept as typed
    pattern: str | None = None  # for str: a regular expression the whole value must match...
    pattern_text: str = ""  # ...and how the allowed values read in errors and docs
    secret: bool = False  # never printed, written or logged: REDACTED stands in (to_dict, reprs, errors)
    off_flag: str = ""  # for bool: the flag that turns it off ("": --no-<flag>)


REDACTED = "***"  # what a secret key's value reads as wherever the config is shown


def setting(default: Any, kind: str, doc: str, **kw: Any) -> Any:
    spec = Spec(kind, doc, **kw)
    # repr=False: a secret must not reach a log line through a dataclass repr (a Config or its table in an f-string)
    return field(default=default, metadata={"spec": spec}, repr=not spec.secret)


# ---------------------------------------------------------------- the schema


@dataclass(frozen=True)
class ModelConfig:
    """The model file."""

    path: str = setting(
        EMBEDDED_MODEL,
        "path",
        'GGUF model file (any shard of a split set); "tiny" is the embedded tiny model, made on first '
        'use; "" means not set yet (the real-model presets), an error when the model is needed',
        allow_empty=True,
        words=(EMBEDDED_MODEL,),
    )
    name: str = setting("", "str", "what model this preset is for; shown in errors and telemetry", allow_empty=True)
    catalog: str = setting(
        "",
        "str",
        'the catalog entry this preset runs (`moe-pipe models --catalog`); with path "" the file `moe-pipe pull` '
        "fetched for it is used, and when there is none the error gives the pull command",
        allow_empty=True,
    )


@dataclass(frozen=True)
class CacheConfig:
    """The expert cache: its budget and eviction policy."""

    cache_mb: float | str = setting(
        "auto",
        "mb",
        'expert cache budget in MiB (fractions allowed); "auto" = memory available to '
        "this process tree (cgroup-aware) minus dense set, KV cache and reserve",
        lo=0,
        hi=MAX_MB,
        lo_open=True,
        flags=("--cache-mb",),
    )
    cache_ceil_mb: float | str = setting(
        "auto",
        "mb",
        "upper clamp on the budget in MiB, for auto and fixed budgets; "
        '"auto" = the platform\'s: on a phone (Android) 35 % of its RAM, left to the OS and other apps; '
        "elsewhere none, the cache takes what the budget finds",
        lo=0,
        hi=MAX_MB,
        lo_open=True,
        flags=("--cache-ceil-mb",),
    )
    reserve_mb: float = setting(
        512.0,
        "float",
        "the least memory auto leaves free for the processes themselves and the system; "
        "auto leaves the engine's own estimate (its processes' measured footprint, "
        "shared/experts/budget.py) when that is larger",
        lo=0,
        hi=MAX_MB,
        flags=("--reserve-mb",),
    )
    lend_kv: bool = setting(
        True,
        "bool",
        "with an auto budget and one slot, the expert cache also holds the KV cache's memory that the "
        "context does not use yet, and gives it back as the context grows, before the KV cache writes "
        "there (docs/architecture.md § The KV cache's loan); --no-lend-kv keeps the cache to its budget",
        flags=("--lend-kv",),
        off_flag="--no-lend-kv",
    )
    lend_prompt: bool = setting(
        True,
        "bool",
        "with an auto budget and one slot, the expert cache also holds the memory set aside for a long "
        "prompt chunk's activations while no such chunk runs, and gives it back before one does "
        "(docs/architecture.md § The prompt's loan); --no-lend-prompt keeps the cache to its budget",
        flags=("--lend-prompt",),
        off_flag="--no-lend-prompt",
    )
    policy: str = setting(
        DEFAULT_POLICY,
        "choice",
        "expert eviction policy (docs/cache-policies.md; belady is simulator-only: moe-pipe replay)",
        choices=LIVE_POLICIES,
        flags=("--policy",),
    )
    warm_from: str | None = setting(
        None,
        "path",
        "a route trace of an earlier run: the service starts by reading its most used experts into the cache (as many as fit)",
        unset="start cold",
        flags=("--warm-from",),
    )
    warm_start: bool = setting(
        True,
        "bool",
        "a service (`up`) starts by reading the hot set its last run of the same model file saved "
        "(the experts its cache held, hottest first) in the background, behind every read a request "
        "needs; --cold skips it (the hot set is still saved). cache.warm_from, when set, is read instead",
        flags=("--warm-start",),
        off_flag="--cold",
    )
    warm_save_s: float = setting(
        30.0,
        "float",
        "how often a service saves its hot set while it serves, in seconds (only when the cache was "
        "used since); it is saved at `down` too, and a crash keeps the last save; 0 = only at `down`",
        lo=0,
        hi=86400,
    )


@dataclass(frozen=True)
class IOConfig:
    """Flash reads: expert lanes and how the dense set is loaded."""

    io_threads: int = setting(4, "int", "parallel O_DIRECT read lanes for expert misses", lo=1, hi=64, flags=("--io-threads",))
    compute_reads: int = setting(
        32,
        "int",
        "cache slabs lent to compute, which reads a decoded token's misses into them itself on io_threads lanes of its own "
        "(no round trip to the reader a miss; docs/architecture.md § compute's own reads); at most 1/64 of the cache (one slab at least); "
        "0 = every miss goes through the reader",
        lo=0,
        hi=4096,
        flags=("--compute-reads",),
    )
    dense_weights: str = setting(
        "anon",
        "choice",
        "how the non-expert weights are held: anon = O_DIRECT read into shared memory "
        "(never re-faulted); warm = one buffered sweep, then the file mapping; mmap = lazy "
        "file mapping",
        choices=("anon", "warm", "mmap"),
        flags=("--dense-weights",),
    )
    populate: bool = setting(
        True,
        "bool",
        "map the slab cache's and the dense set's pages into the reading processes ahead of the reads, "
        "on a thread (an O_DIRECT read into an unmapped page runs at about half speed); false leaves it to the reads",
        flags=("--populate",),
    )


@dataclass(frozen=True)
class ComputeConfig:
    """The forward pass."""

    threads: int | None = setting(
        None, "int", "compute threads", lo=1, hi=256, unset="the free cores, measured at start", flags=("-t", "--threads")
    )
    overlap: bool = setting(True, "bool", "compute cache hits while misses are read; false waits for the whole set", flags=("--overlap",))
    prefetch: str = setting(
        "prompt",
        "choice",
        "guess the next layer's experts with its router on this layer's hidden state and read the confident ones (p >= 0.05) not cached, after this layer's misses: "
        "prompt = while a prompt's batch runs (its pass is compute-bound, the disk is free; docs/warmup-analysis.md), "
        "next-layer = while decoding too (a wrong guess costs a read and a cached expert; docs/benchmarks.md), none = never",
        choices=("none", "prompt", "next-layer"),
        flags=("--prefetch",),
    )
    n_expert_used: int | None = setting(
        None,
        "int",
        "LOSSY unless it is the model's own: routed experts per token (llama.cpp's --n-expert-used); fewer than trained "
        "is faster and changes outputs, more is slower and changes them too; a run says so when it differs",
        lo=1,
        hi=256,
        unset="the model's own",
        flags=("--n-expert-used",),
    )
    ctx_size: int = setting(4096, "int", "context length in tokens (sizes the KV cache)", lo=16, hi=1 << 20, flags=("-c", "--ctx-size"))
    prefill_chunk: int | None = setting(
        None,
        "int",
        "prompt tokens that go through the model one layer at a time: each layer's routed experts are asked for once per "
        "chunk and each applied to all its tokens at once, so a prompt in one chunk reads each expert at most once; "
        "the chunk's activations (about 105 KiB a token on qwen30b-shape, 4,096 tokens: 420 MiB) are left out of the expert cache",
        lo=1,
        hi=1 << 20,
        unset=f"the whole context up to {AUTO_PREFILL_CHUNK} tokens, up to {SLOT_PREFILL_CHUNK} with gateway.parallel above 1",
        flags=("--prefill-chunk",),
    )
    draft: int = setting(
        0,
        "int",
        "speculative decoding: guess up to N tokens ahead and check them with the decoded token in one pass over "
        "the weights; the output is exactly the output without it (docs/speculative.md); 0 = off",
        lo=0,
        hi=MAX_DRAFT,
        flags=("--draft",),
    )
    draft_adapt: bool = setting(
        True,
        "bool",
        "choose each pass's drafts, 0 to --draft, from the acceptance and the pass times measured so far "
        "(0 when no width pays, tried again now and then); false = always --draft",
        flags=("--draft-adapt",),
    )
    draft_source: str = setting(
        "ngram",
        "choice",
        "where --draft's guesses come from: ngram = the tokens that followed the latest earlier occurrence of the "
        "last few tokens in the prompt and output (repeated text drafts, anything else costs nothing); mtp = the model "
        "file's own MTP/NextN block (Qwen3.5/3.6, GLM-4.5, Ling files that carry one), one extra layer and the output "
        "head per guess; none = no drafts",
        choices=DRAFT_SOURCES,
        flags=("--draft-source",),
    )
    draft_vocab: int = setting(
        32768,
        "int",
        "--draft-source mtp: each guess is the block's most likely token among the N lowest token ids (a byte-level "
        "BPE vocabulary's commonest) and the ids the conversation has had, not the whole vocabulary, so the head reads "
        "N rows, not all; the output is the same either way (docs/speculative.md § MTP drafts); 0 = the whole vocabulary",
        lo=0,
        hi=1 << 24,
        flags=("--draft-vocab",),
    )
    draft_replay: str | None = setting(
        None,
        "path",
        "BENCHMARKS ONLY: draft from a recorded greedy continuation (a JSON file: tokens, accuracy, seed; "
        "bench/bench_speculate.py writes it) with each draft token made wrong at 1 - accuracy, in place of "
        "draft_source: the mechanism's speed at a chosen acceptance on weights whose own drafts are noise",
        unset="draft_source's drafts",
        flags=("--draft-replay",),
    )
    kv_type: str = setting(
        "f16",
        "choice",
        "how the KV cache stores keys and values: f16 = half of f32's bytes; q8_0 = int8 with a float16 scale per 32 "
        "values (34/32 bytes a value; head widths must be multiples of 32); f32 = exact; attention math is float32 in all three",
        choices=KV_TYPES,
        flags=("--kv-type",),
    )
    route_replay: str | None = setting(
        None,
        "path",
        "BENCHMARKS ONLY, the tokens are not the model's: route every "
        "token by a recorded route trace's choices (layer by layer, cycled) so a "
        "synthetic model reads like the real one",
        unset="the model's own router",
        flags=("--route-replay",),
    )
    drop_cold_experts: float = setting(
        0.0,
        "float",
        "LOSSY, changes outputs: while decoding, skip a routed expert that "
        "is a cache miss with weight below this fraction of an even share; 0 = off",
        lo=0,
        hi=1,
        flags=("--drop-cold-experts",),
    )
    cache_route: float = setting(
        0.0,
        "float",
        "LOSSY, changes outputs: while decoding, swap a missing routed expert "
        "for a cached one whose router probability is within this fraction of it; 0 = off",
        lo=0,
        hi=1,
        flags=("--cache-route",),
    )
    route_ahead: bool = setting(
        False,
        "bool",
        "LOSSY, changes outputs: while decoding, route each layer with its router on the previous "
        "layer's router input, so its experts are known and read a layer early",
        flags=("--route-ahead",),
    )

    @property
    def drafts_from_block(self) -> bool:
        """--draft takes its guesses from the model file's MTP block (a benchmark's replay
        file, draft_replay, drafts in its place)."""
        return bool(self.draft) and self.draft_source == "mtp" and not self.draft_replay

    @property
    def prefill_tokens(self) -> int:
        """The prompt chunk in tokens: the key's value, or the whole context up to AUTO_PREFILL_CHUNK."""
        return self.prefill_chunk or min(self.ctx_size, AUTO_PREFILL_CHUNK)


@dataclass(frozen=True)
class GenerateConfig:
    """Sampling defaults (a request may override them)."""

    max_tokens: int = setting(64, "int", "tokens to generate at most", lo=1, hi=1 << 20, flags=("-n", "--max-tokens"))
    # OpenAI's range, the one the HTTP API checks too (shared/serve/openai_api.py): the same everywhere.
    temperature: float = setting(
        0.0, "float", "sampling temperature; 0 = greedy; OpenAI's range, as over HTTP", lo=0, hi=2, flags=("--temp", "--temperature")
    )
    top_k: int = setting(
        0, "int", "sample among the K most likely tokens (llama.cpp's --top-k); 0 = off", lo=0, hi=1 << 20, flags=("--top-k",)
    )
    seed: int | None = setting(None, "int", "random seed for sampling", lo=0, hi=2**64 - 1, unset="random", flags=("--seed",))
    no_think: bool = setting(
        False, "bool", "ask the model not to think (Qwen3 enable_thinking=false, gpt-oss reasoning low)", flags=("--no-think",)
    )
    chat_template: str = setting(
        "model",
        "path",
        'how chat turns become the prompt: "model" = the GGUF\'s own '
        "tokenizer.chat_template (untrusted: run in a sandbox with time, size and memory "
        'limits); "plain" = one "role: content" line per turn, for a model whose template is '
        "missing or refused; or a Jinja template file of your own (sandboxed too)",
        words=CHAT_TEMPLATE_WORDS,
        flags=("--chat-template",),
    )
    context_shift: bool = setting(
        False,
        "bool",
        "when the context fills while generating, drop the oldest half of the tokens past n_keep and go on "
        '(the kept tail is recomputed; docs/conversations.md); false = stop with finish_reason "length"',
        flags=("--context-shift",),
    )
    n_keep: int = setting(
        0,
        "int",
        "tokens at the start of the context a context shift always keeps (a BOS is kept on top); -1 = the whole prompt",
        lo=-1,
        hi=1 << 20,
        flags=("--keep",),
    )


@dataclass(frozen=True)
class TelemetryConfig:
    """Per-token records."""

    csv: str | None = setting(None, "path", "per-token CSV to write", unset="no CSV", flags=("--csv",))
    route_trace: str | None = setting(
        None,
        "path",
        "record every routing decision to this route trace (docs/cache-policies.md; appended to if it exists)",
        unset="no trace",
        flags=("--route-trace",),
    )


@dataclass(frozen=True)
class SupervisorConfig:
    """Restarts, supervisord-style: per-process policy, start_secs, start_retries, exponential backoff."""

    start_secs: float = setting(1.0, "float", "seconds a child must stay up to count as started (RUNNING)", lo=0, hi=3600)
    start_retries: int = setting(3, "int", "failed starts in a row before a child is FATAL", lo=0, hi=1000)
    backoff_s: float = setting(1.0, "float", "delay before the first restart; doubles on each retry", lo=0, hi=3600, lo_open=True)
    backoff_cap_s: float = setting(30.0, "float", "longest delay between restarts", lo=0, hi=86400, lo_open=True)
    stop_wait_s: float = setting(5.0, "float", "seconds between SIGTERM and SIGKILL when stopping a child", lo=0, hi=3600)
    reader_restart: str = setting(
        "always",
        "choice",
        "when to restart the expert reader: always; on-failure = after a nonzero exit or a signal only; never",
        choices=RESTART_POLICIES,
    )
    compute_restart: str = setting("always", "choice", "when to restart the compute worker (as reader_restart)", choices=RESTART_POLICIES)
    telemetry_restart: str = setting(
        "always", "choice", "when to restart the telemetry recorder (as reader_restart)", choices=RESTART_POLICIES
    )
    gateway_restart: str = setting("always", "choice", "when to restart the HTTP gateway (as reader_restart)", choices=RESTART_POLICIES)


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible HTTP API of `moe-pipe up`."""

    host: str = setting(
        "127.0.0.1",
        "str",
        "address the HTTP API binds; anything but loopback exposes it",
        pattern=r"[A-Za-z0-9._:%-]+",
        pattern_text="an IP address or host name",
        flags=("--host",),
    )
    port: int = setting(8080, "int", "HTTP port; 0 = any free port", lo=0, hi=65535, flags=("--port",))
    api_key: str | None = setting(
        None,
        "str",
        "if set, requests need `Authorization: Bearer KEY`; a secret: telemetry, logs and errors show it as ***. "
        "The environment variable MOE_PIPE_API_KEY sets it too and stays out of the process list, as a flag does not; "
        "`up` refuses a host other than loopback without a key unless given --no-api-key",
        unset="no key",
        flags=("--api-key",),
        pattern=r"[!-~]+",
        pattern_text="visible ASCII characters, no spaces (it travels in an HTTP header)",
        secret=True,
    )
    queue_size: int = setting(16, "int", "requests waiting for the compute worker before new ones get 429", lo=1, hi=10000)
    parallel: int = setting(
        1,
        "int",
        "requests the service's compute decodes at once, each in its own slot with its own KV cache (one batched pass "
        "a step; the caches share gateway.kv_pool; speculative decoding is off above 1; `run` serves one: docs/batching.md)",
        lo=1,
        hi=MAX_PARALLEL,
        flags=("--parallel",),
    )
    kv_pool: int | None = setting(
        None,
        "int",
        "context positions the slots' KV caches hold together (docs/batching.md § The KV pool): a slot takes pages as "
        "its conversation grows, idle slots give theirs back when another needs room, and the budget counts the pool "
        "rather than a whole context a slot, so the expert cache gets the rest; at least compute.ctx_size",
        lo=16,
        hi=1 << 26,
        unset="the context once and a quarter of it for each further slot, at most gateway.parallel contexts",
        flags=("--kv-pool",),
    )
    slot_save_path: str | None = setting(
        None,
        "path",
        "folder where POST /slots/{id}?action=save|restore keeps session files (made if missing; docs/api.md)",
        unset="the slot endpoints answer 501",
        flags=("--slot-save-path",),
    )


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    io: IOConfig = field(default_factory=IOConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    source: str | None = None  # the file it came from (not a TOML key)

    @property
    def kv_pool_tokens(self) -> int:
        """The positions the slots' KV caches hold together (gateway.kv_pool, or its auto size):
        one slot's whole context, as a single slot needs no pool."""
        n, ctx = self.gateway.parallel, self.compute.ctx_size
        if n == 1:
            return ctx
        return self.gateway.kv_pool or min(n * ctx, ctx + (n - 1) * (ctx // KV_POOL_SHARE))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every table and key (None for unset): the record written to telemetry preambles
        and shown to users, so a secret key that is set reads as REDACTED."""
        return {t: {k: redact(KEYS[f"{t}.{k}"], v) for k, v in dataclasses.asdict(getattr(self, t)).items()} for t in TABLES}


TABLES: dict[str, type] = {
    f.name: f.type if isinstance(f.type, type) else globals()[f.type] for f in dataclasses.fields(Config) if f.name != "source"
}


@dataclass(frozen=True)
class Key:
    table: str
    name: str
    default: Any
    spec: Spec

    @property
    def dotted(self) -> str:
        return f"{self.table}.{self.name}"

    @property
    def dest(self) -> str:
        """The argparse destination of this key's flags."""
        return self.name

    def type_text(self) -> str:
        return {
            "int": "integer",
            "float": "number",
            "bool": "boolean",
            "str": "string",
            "path": "path",
            "choice": "string",
            "mb": '"auto" or number',
        }[self.spec.kind]

    def allowed_text(self) -> str:
        s = self.spec
        if s.kind == "choice":
            text = ", ".join(f'"{c}"' for c in s.choices)
        elif s.kind == "bool":
            text = "true, false"
        elif s.kind in ("int", "float", "mb"):
            lo = "" if s.lo is None else f"{'>' if s.lo_open else '>='} {_num(s.lo)}"
            hi = "" if s.hi is None else f"<= {_num(s.hi)}"
            rng = " and ".join(x for x in (lo, hi) if x)
            text = ('"auto" or a number ' if s.kind == "mb" else "an integer " if s.kind == "int" else "a number ") + rng
        elif s.kind == "path":
            options = [f'"{w}"' for w in s.words] + ["a file path"] + (['""'] if s.allow_empty else [])
            text = options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]
        elif s.pattern:
            text = s.pattern_text
        else:
            text = "a string" + ("" if s.allow_empty else " (not empty)")
        if s.unset:
            text += f"; leave out for {s.unset}"
        return text.strip()


SCHEMA: tuple[Key, ...] = tuple(
    Key(table, f.name, f.default, f.metadata["spec"]) for table, cls in TABLES.items() for f in dataclasses.fields(cls)
)
KEYS: dict[str, Key] = {k.dotted: k for k in SCHEMA}


# Old names still read for a release: each use prints one line naming the new key (to stderr, once a process).
RENAMED_KEYS: dict[str, str] = {"compute.top_k": "compute.n_expert_used"}
_said_renamed: set[str] = set()


def renamed(dotted: str, where: str) -> str:
    """The key's current name; an old one says so on stderr (once), then stands for the new."""
    new = RENAMED_KEYS.get(dotted)
    if new is None:
        return dotted
    if dotted not in _said_renamed:
        _said_renamed.add(dotted)
        print(f"moe-pipe: {where}: {dotted} is now {new} (the old name goes in the next release)", file=sys.stderr)
    return new


def redact(key: Key, value: Any) -> Any:
    """The value as it may be shown: a secret that is set reads as REDACTED, unset stays None."""
    return REDACTED if key.spec.secret and value is not None else value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def toml_repr(value: Any) -> str:
    """A value as it would be written in TOML (strings quoted, bools lowercase)."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + '"'  # one line, always
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, (dict, list)):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(value)


# ---------------------------------------------------------------- validation


class _Invalid(Exception):
    """A value a key does not accept; `problem` says how (wrong type, out of range, not allowed)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _check(key: Key, value: Any) -> Any:
    """The value in its canonical form, or _Invalid."""
    s = key.spec
    if value is None:
        if s.unset is None:
            raise _Invalid("must be set")
        return None
    if s.kind == "bool":
        if not isinstance(value, bool):
            raise _Invalid("wrong type, expected true or false")
        return value
    if s.kind in ("str", "path", "choice"):
        if not isinstance(value, str):
            raise _Invalid("wrong type, expected a string")
        if s.kind == "choice" and value not in s.choices:
            near = difflib.get_close_matches(value, s.choices, n=1)
            raise _Invalid("not allowed" + (f' (did you mean "{near[0]}"?)' if near else ""))
        if not value and not s.allow_empty:
            raise _Invalid("must not be empty")
        if _CONTROL.search(value):
            raise _Invalid("contains a control character")
        if len(value) > MAX_TEXT:
            raise _Invalid(f"too long ({len(value)} characters, at most {MAX_TEXT})")
        if s.pattern and value and not re.fullmatch(s.pattern, value):
            raise _Invalid("not allowed")
        return value
    if s.kind == "mb" and isinstance(value, str):
        if value != "auto":
            raise _Invalid('wrong type, expected "auto" or a number')
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("wrong type, expected " + ("an integer" if s.kind == "int" else "a number"))
    if s.kind == "int" and not isinstance(value, int):
        raise _Invalid("wrong type, expected an integer")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Invalid("not a finite number")
    too_low = s.lo is not None and (value <= s.lo if s.lo_open else value < s.lo)
    if too_low or (s.hi is not None and value > s.hi):
        raise _Invalid("out of range")
    return value if s.kind == "int" else float(value)


def _fail(where: str, key: Key, value: Any, problem: str) -> ConfigError:
    shown = toml_repr(redact(key, value))
    if len(shown) > 200:  # a pasted blob: its start is enough to recognise it
        shown = shown[:160] + f"... ({len(shown):,} characters)"
    return ConfigError(f"{where}: {key.dotted} = {shown}: {problem}; allowed: {key.allowed_text()}")


def _suggest(word: str, options: Iterable[str]) -> str:
    near = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f' (did you mean "{near[0]}"?)' if near else ""


def _unknown_key(where: str, table: str, name: str) -> ConfigError:
    names = [k.name for k in SCHEMA if k.table == table]
    elsewhere = [k.table for k in SCHEMA if k.name == name]
    hint = _suggest(name, names)
    if elsewhere:  # the right key in the wrong table ([io] threads = 2)
        hint = f" ({name} belongs in [{elsewhere[0]}]{'; or ' + hint[2:-1] if hint else ''})"
    elif not hint:
        hint = f"; keys of [{table}]: {', '.join(names)}"
    return ConfigError(f"{where}: unknown key {table}.{name}{hint}")


def _unknown_table(where: str, name: str, value: Any) -> ConfigError:
    if not isinstance(value, dict):
        homes = [k.dotted for k in SCHEMA if k.name == name]
        if homes:
            return ConfigError(f"{where}: key {name} must be inside a table: write it under [{homes[0].split('.')[0]}]")
        return ConfigError(f"{where}: unknown top-level key {name}{_suggest(name, TABLES)}; tables: {', '.join(f'[{t}]' for t in TABLES)}")
    return ConfigError(f"{where}: unknown table [{name}]{_suggest(name, TABLES)}; tables: {', '.join(f'[{t}]' for t in TABLES)}")


def _line_of(text: str, table: str, name: str) -> int | None:
    """The line where `name` is set inside [table] (best effort: plain `key = value` lines)."""
    current = None
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        head = re.match(r"\[\s*([A-Za-z0-9_.-]+)\s*\]", stripped)
        if head:
            current = head.group(1)
        elif current == table and re.match(rf'["\']?{re.escape(name)}["\']?\s*=', stripped):
            return no
    return None


def _validate_tables(doc: Mapping[str, Any], origin: str, text: str) -> dict[str, dict[str, Any]]:
    """The document's tables, every key checked; first problem raised as ConfigError."""
    out: dict[str, dict[str, Any]] = {}
    for table, body in doc.items():
        if table not in TABLES or not isinstance(body, dict):
            raise _unknown_table(origin, table, body)
        for name, value in body.items():
            line = _line_of(text, table, name)
            where = f"{origin}:{line}" if line else origin
            key = KEYS.get(renamed(f"{table}.{name}", where))
            if key is None:
                raise _unknown_key(where, table, name)
            try:
                out.setdefault(key.table, {})[key.name] = _check(key, value)
            except _Invalid as exc:
                raise _fail(where, key, value, exc.problem) from None
    return out


def _resolve_path(value: str | None, base: Path, words: tuple[str, ...] = ()) -> str | None:
    if value in (None, "") or value in words:
        return value
    return str((base / Path(value).expanduser()).resolve())


def _build(tables: Mapping[str, Mapping[str, Any]], base: Config, path_base: Path, source: str | None) -> Config:
    parts = {}
    for table in TABLES:
        values = dict(tables.get(table, {}))
        for name, value in values.items():
            spec = KEYS[f"{table}.{name}"].spec
            if spec.kind == "path":
                values[name] = _resolve_path(value, path_base, spec.words)
        parts[table] = dataclasses.replace(getattr(base, table), **values)
    cfg = dataclasses.replace(base, source=source, **parts)
    _cross_check(cfg, source or "config")
    return cfg


def _cross_check(cfg: Config, where: str) -> None:
    sup = cfg.supervisor
    if sup.backoff_cap_s < sup.backoff_s:
        raise ConfigError(
            f"{where}: supervisor.backoff_cap_s = {_num(sup.backoff_cap_s)} is below supervisor.backoff_s = "
            f"{_num(sup.backoff_s)}; allowed: backoff_cap_s >= backoff_s"
        )


# ---------------------------------------------------------------- loading


def parse_toml(path: Path) -> tuple[dict[str, Any], str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file; presets are in configs/ (tiny.toml runs anywhere)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a TOML config file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text at byte {exc.start}; a config is a TOML text file") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            msg = msg[: m.start()].strip()
            raise ConfigError(f"{path}:{m.group(1)}: invalid TOML at column {m.group(2)}: {msg}") from None
        raise ConfigError(f"{path}: invalid TOML: {msg}") from None


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """The config in `path` (None: every default) with `overrides` ({"cache.cache_mb": 0.5, ...}) applied.

    Parsed and validated only: which model file it names, and whether the files
    a run reads are there, are the caller's to check (shared/hub/resolve.py).
    """
    if path is None:
        cfg = Config()
    else:
        p = Path(path)
        doc, text = parse_toml(p)
        cfg = _build(_validate_tables(doc, str(p), text), Config(), p.resolve().parent, str(p))
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    return cfg


def check_kv_pool(cfg: Config) -> None:
    """A KV pool smaller than one context would leave a conversation no room to reach it: refused at start-up."""
    pool, ctx = cfg.gateway.kv_pool, cfg.compute.ctx_size
    if pool is not None and cfg.gateway.parallel > 1 and pool < ctx:
        raise ConfigError(
            f"{cfg.source or 'command line'}: gateway.kv_pool = {pool} is below compute.ctx_size = {ctx}: "
            f"one conversation must be able to fill its context (set it to at least {ctx}, or leave it out)"
        )


def check_chat_template(cfg: Config) -> None:
    """A chat template file that is not there fails at start-up, not at the first chat request."""
    value = cfg.generate.chat_template
    p = Path(value)
    if value in CHAT_TEMPLATE_WORDS or p.is_file():
        return
    problem = "is a folder" if p.is_dir() else "not a file" if p.exists() else "no such file"
    raise ConfigError(
        f"{cfg.source or 'command line'}: generate.chat_template = {toml_repr(value)}: {problem}; "
        f"allowed: {KEYS['generate.chat_template'].allowed_text()}"
    )


def apply_overrides(cfg: Config, overrides: Mapping[str, Any], *, where: str = "command line", base: Path | None = None) -> Config:
    """A new Config with dotted keys replaced; paths resolve against `base` (default: the current folder)."""
    tables: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        key = _known(dotted, where)
        try:
            tables.setdefault(key.table, {})[key.name] = _check(key, value)
        except _Invalid as exc:
            raise _fail(where, key, value, exc.problem) from None
    return _build(tables, cfg, base or Path.cwd(), cfg.source)


def _known(dotted: str, where: str) -> Key:
    """The key named `dotted` (an old name too), or a ConfigError suggesting the nearest."""
    key = KEYS.get(renamed(dotted, where))
    if key is None:
        table, _, name = dotted.partition(".")
        if table not in TABLES or not name:
            hint = _suggest(dotted, KEYS) or f"; a key is TABLE.KEY, tables: {', '.join(TABLES)}"
            raise ConfigError(f"{where}: unknown key {dotted}{hint}")
        raise _unknown_key(where, table, name)
    return key
