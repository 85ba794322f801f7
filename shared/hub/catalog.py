"""The models moe-pipe knows: for each, the repository and quant `moe-pipe
pull` fetches, the recipe in configs/ that runs it, and its size.

The repositories are the usual GGUF repositories for each model as of
writing (late 2026); they were not checked against the Hub from here, so a
renamed one shows up as a one-line "no such repository" from `pull`.

Sizes: `file_bytes` is the whole GGUF (all shards), `routed_bytes_per_token`
what one token reads with no cache (every layer's top-k experts), both as
`moe-pipe inspect --json` reports them. Where a shape preset of
its family (shared/families/<family>/plan.py) matches the model they come from it (`sizes`
names it; made with `sparse=True` at full depth and inspected); otherwise
they are estimates from the model's published shape at the quant's mix
(llama.cpp's Q4_K_M: gate and up Q4_K, down Q6_K in half the layers and
Q4_K in the rest, with its Q5_0 / Q8_0 fallbacks on rows not a multiple of
256 wide), and `sizes` says "estimate".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

# The recipes: configs/ beside shared/ in the source tree, and moe_pipe/configs (package data) when installed
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class Shape:
    """The make-model arguments that give a header of the entry's shape (its family's shape
    preset at the entry's depth, expert count and expert type): what `doctor NAME` forecasts
    from offline, before anything is fetched (shared/hub/shape.py)."""

    preset: str
    layers: int | None = None
    experts: str | None = None  # the routed experts' type, when the mix's own is not it
    mtp: bool = False
    n_expert: int | None = None  # a preset's expert count changed (gpt-oss-20b: 32 of gpt-oss-120b's 128)

    def make_args(self) -> dict:
        """Keyword arguments of makemodel.make_model / make_header."""
        args: dict = {"layers": self.layers, "experts": self.experts, "mtp": self.mtp}
        if self.n_expert is not None:
            args["_overrides"] = {"n_expert": self.n_expert}
        return args


@dataclass(frozen=True)
class Entry:
    name: str  # what `moe-pipe up NAME` takes: lower case, digits, '-', '.'
    model: str  # the model's own name
    arch: str  # general.architecture of its GGUF
    repo: str  # the Hugging Face repository of its GGUFs
    quant: str  # the quant `pull` fetches (a file-name tag: Q4_K_M, MXFP4)
    recipe: str  # the config file in configs/ that runs it
    file_bytes: int
    routed_bytes_per_token: int
    shards: int  # files in the set: 1, or a split set's count
    sizes: str  # where file_bytes and routed_bytes_per_token come from
    shape: Shape  # its shape as make-model makes it: the offline forecast's header

    @property
    def mix(self) -> str:
        """Which tensors of its file take which quant type (MIXES)."""
        return MIXES[self.quant]

    @property
    def pull_ref(self) -> str:
        return f"{self.repo}:{self.quant}"

    @property
    def pull_command(self) -> str:
        return f"moe-pipe pull {self.pull_ref}"

    def recipe_path(self) -> Path:
        return CONFIGS_DIR / self.recipe


ESTIMATE = "estimate from the published shape"

# The quant mixes the entries' files use: which tensors take which type, as llama.cpp's
# quantizer chooses them for that file type (its llama-quant.cpp), before its row-width
# fallback (Q4_K -> Q5_0, Q6_K -> Q8_0 on rows not a multiple of 256 wide); the rules:
# docs/formats.md § Real files' quant mixes. moe-pipe reads each tensor's type from the file, so a mix is
# information for choosing a download, never an assumption of the reader.
MIXES: dict[str, str] = {
    "Q4_K_M": "experts' gate/up Q4_K; down and attn_v Q6_K in 1/3 of the layers (the first and last eighth, every third between), "
    "Q4_K in the rest; other matrices Q4_K; output head Q6_K",
    "MXFP4": "experts MXFP4 (as trained); every other matrix Q8_0",
    "IQ2_XXS": "experts IQ2_XXS (llama.cpp's rules: down Q2_K in the first eighth of the layers, attn_v Q4_K, "
    "token embedding Q2_K, output head Q5_K; unsloth's UD files keep more tensors wider); the rest as the file says",
}

CATALOG: tuple[Entry, ...] = (
    Entry(
        "qwen3-30b-a3b",
        "Qwen3-30B-A3B",
        "qwen3moe",
        "unsloth/Qwen3-30B-A3B-GGUF",
        "Q4_K_M",
        "qwen30b.toml",
        18_554_177_856,
        1_097_072_640,
        1,
        "shape preset qwen30b-shape",
        Shape("qwen30b-shape"),
    ),
    Entry(
        "gpt-oss-120b",
        "gpt-oss-120b",
        "gpt-oss",
        "ggml-org/gpt-oss-120b-GGUF",
        "MXFP4",
        "gptoss120b.toml",
        63_380_502_400,
        1_908_541_440,
        3,
        "shape preset gptoss120b-shape",
        Shape("gptoss120b-shape"),
    ),
    Entry(
        "gpt-oss-20b",
        "gpt-oss-20b",
        "gpt-oss",
        "ggml-org/gpt-oss-20b-GGUF",
        "MXFP4",
        "gptoss20b.toml",
        12_102_722_816,
        1_272_360_960,
        1,
        "shape preset gptoss120b-shape at 24 layers x 32 experts",
        Shape("gptoss120b-shape", layers=24, n_expert=32),
    ),
    Entry(
        "gemma-4-26b-a4b",
        "Gemma-4-26B-A4B",
        "gemma4",
        "unsloth/gemma-4-26B-A4B-it-GGUF",
        "Q4_K_M",
        "gemma26b.toml",
        16_786_979_712,
        945_635_328,
        1,
        "shape preset gemma26b-shape",
        Shape("gemma26b-shape"),
    ),
    Entry(
        "qwen3.5-35b-a3b",
        "Qwen3.5-35B-A3B",
        "qwen35moe",
        "unsloth/Qwen3.5-35B-A3B-GGUF",
        "Q4_K_M",
        "qwen35-35b.toml",
        21_647_336_640,
        609_484_800,
        1,
        "shape preset qwen35-35b-shape with its MTP block (make-model --mtp)",
        Shape("qwen35-35b-shape", mtp=True),
    ),
    # the same shape as Qwen3.5-35B-A3B; its files carry the MTP block too (checked, never read)
    Entry(
        "qwen3.6-35b-a3b",
        "Qwen3.6-35B-A3B",
        "qwen35moe",
        "unsloth/Qwen3.6-35B-A3B-GGUF",
        "Q4_K_M",
        "qwen36-35b.toml",
        21_647_336_640,
        609_484_800,
        1,
        "shape preset qwen35-35b-shape with its MTP block (make-model --mtp)",
        Shape("qwen35-35b-shape", mtp=True),
    ),
    # 26 MoE layers (the first is dense) x top-6 of 64, 2048 x 1408 experts
    Entry(
        "deepseek-v2-lite",
        "DeepSeek-V2-Lite-Chat",
        "deepseek2",
        "bartowski/DeepSeek-V2-Lite-Chat-GGUF",
        "Q4_K_M",
        "deepseek-v2-lite.toml",
        10_366_269_888,
        893_190_144,
        1,
        "shape preset deepseek-v2-lite-shape",
        Shape("deepseek-v2-lite-shape"),
    ),
    # 45 MoE layers (the first is dense) x top-8 of 128, 4096 x 1408 experts; unsloth keeps it in a Q4_K_M/ folder, 2 shards
    Entry(
        "glm-4.5-air",
        "GLM-4.5-Air",
        "glm4moe",
        "unsloth/GLM-4.5-Air-GGUF",
        "Q4_K_M",
        "glm45air.toml",
        70_442_319_552,
        4_126_408_704,
        2,
        "shape preset glm45air-shape (without the NextN block)",
        Shape("glm45air-shape"),
    ),
    # 42 layers (the first 2 dense; KDA with gated MLA every 6th) x top-8 of 512, 2560 x 768 experts, 1 shared
    Entry(
        "ling-3.0-flash",
        "Ling-3.0-flash",
        "bailingmoe3",
        "inclusionAI/Ling-3.0-flash-GGUF",
        "Q4_K_M",
        "ling3-flash.toml",
        75_274_280_992,
        1_138_728_960,
        1,
        "shape preset ling-3-flash-shape",
        Shape("ling-3-flash-shape"),
    ),
    # 43 layers x top-6 of 256, 4096 x 2048 experts, 1 shared; hyper-connections, CSA/HCA attention
    Entry(
        "deepseek-v4-flash",
        "DeepSeek-V4-Flash",
        "deepseek4",
        "unsloth/DeepSeek-V4-Flash-GGUF",
        "IQ2_XXS",
        "deepseek-v4-flash.toml",
        80_318_129_888,
        1_673_920_512,
        1,
        "shape preset deepseek-v4-flash-shape with IQ2_XXS experts (make-model --experts IQ2_XXS), the rest the published q4 file's mix",
        Shape("deepseek-v4-flash-shape", experts="IQ2_XXS"),
    ),
    # 32 layers x top-2 of 8, 4096 x 14336 experts
    Entry(
        "mixtral-8x7b",
        "Mixtral-8x7B-Instruct-v0.1",
        "llama",
        "TheBloke/Mixtral-8x7B-Instruct-v0.1-GGUF",
        "Q4_K_M",
        "mixtral-8x7b.toml",
        28_448_643_040,
        6_826_229_760,
        1,
        "shape preset mixtral-8x7b-shape",
        Shape("mixtral-8x7b-shape"),
    ),
    # 22 MoE layers (the first 2 are dense) x top-4 of 32, 2048 x 1792 experts
    Entry(
        "lfm2-8b-a1b",
        "LFM2-8B-A1B",
        "lfm2moe",
        "LiquidAI/LFM2-8B-A1B-GGUF",
        "Q4_K_M",
        "lfm2-8b.toml",
        5_044_370_560,
        582_844_416,
        1,
        "shape preset lfm2-8b-shape",
        Shape("lfm2-8b-shape"),
    ),
    # 24 layers x top-4 of 60, 2048 x 1408 experts (the 5632-wide shared expert stays resident)
    Entry(
        "qwen1.5-moe-a2.7b",
        "Qwen1.5-MoE-A2.7B-Chat",
        "qwen2moe",
        "Qwen/Qwen1.5-MoE-A2.7B-Chat-GGUF",
        "Q4_K_M",
        "qwen2moe.toml",
        8_840_000_000,
        553_648_128,
        1,
        ESTIMATE,
        Shape("qwen15-moe-shape"),
    ),
)

BY_NAME = {e.name: e for e in CATALOG}


def find(name: str) -> Entry | None:
    return BY_NAME.get(name.lower())


def nearest(name: str, n: int = 3) -> list[str]:
    """The catalog names closest to a mistyped one (difflib), best first; [] when none is close."""
    return difflib.get_close_matches(name.lower(), list(BY_NAME), n=n, cutoff=0.5)


def names_hint(name: str) -> str:
    """What to say about a name not in the catalog: the nearest names, else all of them."""
    near = nearest(name)
    if near:
        return f"did you mean {' or '.join(near)}? (moe-pipe models --catalog lists them)"
    return f"the catalog: {', '.join(BY_NAME)}"


def get(name: str, where: str = "catalog") -> Entry:
    """The entry called `name`, or a one-line error with the nearest names."""
    entry = find(name)
    if entry is None:
        raise UserError(f"{where}: {name!r} is not in the catalog; {names_hint(name)}")
    return entry
