"""The NextN/MTP block: the multi-token-prediction layers a file may carry after
the decoder's, checked when it opens and otherwise left on disk.

llama.cpp's converter writes them as extra blocks: `block_count` counts them,
`<arch>.nextn_predict_layers` says how many of the last blocks they are, and each
is a whole decoder layer (attention, router, experts, shared expert; qwen35moe's
is a full-attention layer) plus its own `nextn.*` tensors:

    blk.N.nextn.eh_proj           [D, 2·D]  the embedding and the hidden state, concatenated, back to D
    blk.N.nextn.enorm / hnorm     [D]       their norms
    blk.N.nextn.shared_head_norm  [D]       the final norm before the (shared) output head
    blk.N.nextn.embed_tokens      [V, D]    optional: the model's token_embd is used without it
    blk.N.nextn.shared_head_head  [V, D]    optional: the model's output head likewise
    blk.N.layer_output_norm       [D]       bailingmoe3's (Ling's `final_layernorm`): its shared-head norm

llama.cpp runs them only as a speculative-decoding draft; the decoder never reads
them. moe-pipe does the same: their tensors are neither streamed nor in the dense
set (layout.py), and `ModelSpec.n_layer_nextn` with the layer numbers after
`n_layer` says where they are. `--draft-source mtp` runs the first one as a drafter
(shared/model/mtp.py), reading it through the file mapping; `nextn_spec` is the spec
that drafter's layer code sees.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..errors import GGUFError, UserError
from .reader import GGUFFile
from .spec import ModelSpec, Shapes

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# What llama.cpp's loader requires of every NextN block (the rest of its own tensors are optional).
REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


def nextn_layers(spec: ModelSpec) -> range:
    """The block numbers of the NextN/MTP layers: the ones after the decoder's."""
    return range(spec.n_layer, spec.n_layer + spec.n_layer_nextn)


def require_nextn(spec: ModelSpec) -> None:
    """--draft-source mtp needs the block: a UserError in one line when the file has none."""
    if not spec.n_layer_nextn:
        raise UserError(
            f"--draft-source mtp needs a model file with an MTP/NextN block; this {spec.arch} file has none "
            "(nextn_predict_layers is 0): use --draft-source ngram"
        )


def nextn_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with the first NextN block as one more layer (number `spec.n_layer`), so a
    family's own layer code runs it: an attention layer over the whole context, shaped as
    the decoder's last such layer (check_nextn holds its tensors to that), never recurrent
    or sliding (qwen35moe's and bailingmoe3's MTP layers are their full-attention kind)."""
    if not spec.n_layer_nextn:
        raise ValueError(f"{spec.arch}: the file has no NextN/MTP block")
    like = max((i for i in range(spec.n_layer) if not spec.is_recurrent(i) and not spec.swa_layers[i]), default=spec.n_layer - 1)
    return replace(
        spec,
        n_layer=spec.n_layer + 1,
        n_layer_nextn=spec.n_layer_nextn - 1,
        n_head_kv=(*spec.n_head_kv, spec.n_head_kv[like]),
        head_dim_k=(*spec.head_dim_k, spec.head_dim_k[like]),
        head_dim_v=(*spec.head_dim_v, spec.head_dim_v[like]),
        swa_layers=(*spec.swa_layers, False),
        recurrent_layers=(*spec.recurrent_layers, False) if spec.recurrent_layers else (),
    )


def nextn_tensor_names(f: GGUFFile, spec: ModelSpec) -> frozenset[str]:
    """Every tensor of the NextN/MTP block."""
    blocks = nextn_layers(spec)
    return frozenset(n for n in f.tensors if (m := _BLOCK.match(n)) and int(m[1]) in blocks)


def own_shapes(spec: ModelSpec, j: int) -> Shapes:
    """The shapes of block j's `nextn.*` tensors (numpy order)."""
    p, d, v = f"blk.{j}.nextn.", spec.n_embd, spec.n_vocab
    return {
        p + "eh_proj.weight": ("matrix", (d, 2 * d), f"n_embd {d}, 2 × n_embd (embedding and hidden state)"),
        p + "enorm.weight": ("vector", (d,), f"n_embd {d}"),
        p + "hnorm.weight": ("vector", (d,), f"n_embd {d}"),
        p + "shared_head_norm.weight": ("vector", (d,), f"n_embd {d}"),
        p + "embed_tokens.weight": ("matrix", (v, d), f"n_vocab {v}, n_embd {d}"),
        p + "shared_head_head.weight": ("matrix", (v, d), f"n_vocab {v}, n_embd {d}"),
        f"blk.{j}.layer_output_norm.weight": ("vector", (d,), f"n_embd {d}"),
    }


def _decoder_twins(f: GGUFFile, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """suffix -> shape of that tensor in the last decoder layer that has it: the block's
    decoder-layer tensors (attention, router, experts) must be shaped like the decoder's."""
    out: dict[str, tuple[int, ...]] = {}
    for name, t in f.tensors.items():
        m = _BLOCK.match(name)
        if m and int(m[1]) < spec.n_layer:
            out[m[2]] = t.shape
    return out


def check_nextn(f: GGUFFile, spec: ModelSpec) -> None:
    """Each NextN block holds llama.cpp's required `nextn.*` tensors, they have the shapes
    the metadata implies, and its decoder-layer tensors are shaped as the decoder's are;
    a block with no tensors at all (block_count counting a block the file lacks) is refused."""
    if not spec.n_layer_nextn:
        return
    names = nextn_tensor_names(f, spec)
    twins = _decoder_twins(f, spec)
    for j in nextn_layers(spec):
        for suffix in REQUIRED:
            if f"blk.{j}.{suffix}" not in names:
                raise GGUFError(
                    f.path, f"missing tensor 'blk.{j}.{suffix}': nextn_predict_layers {spec.n_layer_nextn} makes block {j} a NextN block"
                )
        own = own_shapes(spec, j)
        for name in sorted(n for n in names if n.startswith(f"blk.{j}.")):
            shape = f.tensors[name].shape
            if name in own:
                want, basis = own[name][1], own[name][2]
            else:
                suffix = name.split(".", 2)[2]
                if suffix not in twins:
                    continue  # a tensor of its own llama.cpp does not load either
                want, basis = twins[suffix], f"as the decoder's {suffix}"
            if shape != want:
                raise GGUFError(f.path, f"tensor {name!r} has shape {list(shape)} (numpy order), expected {list(want)} ({basis})")
