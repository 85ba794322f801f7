"""Small hand-made GGUF files for the format tests, written with gguf-py's own
writer (so they are independent of the project's make-model), plus helpers to
corrupt one field in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter

from moe_pipe.shared.quant.blocks import block_format, random_blocks


def _quant(rng, qtype, shape):
    fmt = block_format(qtype)
    data = random_blocks(qtype, int(np.prod(shape)), rng)
    return data.reshape(*shape[:-1], fmt.row_bytes(shape[-1]))


def write_qwen_like(
    path: Path,
    *,
    n_layer=2,
    n_expert=4,
    n_used=2,
    n_embd=64,
    n_ff=32,
    n_head=4,
    n_kv=2,
    head_dim=16,
    vocab=96,
    expert_qtype=QT.Q8_0,
    alignment=None,
    split_max_tensors=0,
    meta_expert_count=None,
    block_count_as_string=False,
    dense_lead=0,
) -> Path:
    """A qwen3moe-shaped model with random weights; returns the (first) path."""
    rng = np.random.default_rng(1)
    w = GGUFWriter(str(path), "qwen3moe", split_max_tensors=split_max_tensors)
    if block_count_as_string:
        w.add_string("qwen3moe.block_count", str(n_layer))
    else:
        w.add_block_count(n_layer)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff * 2)
    w.add_expert_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(meta_expert_count or n_expert)
    w.add_expert_used_count(n_used)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    w.add_tensor("token_embd.weight", _quant(rng, QT.Q8_0, (vocab, n_embd)), raw_dtype=QT.Q8_0)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", f32(n_embd))
        w.add_tensor(p + "attn_q.weight", _quant(rng, QT.Q8_0, (n_head * head_dim, n_embd)), raw_dtype=QT.Q8_0)
        w.add_tensor(p + "attn_k.weight", _quant(rng, QT.Q8_0, (n_kv * head_dim, n_embd)), raw_dtype=QT.Q8_0)
        w.add_tensor(p + "attn_v.weight", _quant(rng, QT.Q8_0, (n_kv * head_dim, n_embd)), raw_dtype=QT.Q8_0)
        w.add_tensor(p + "attn_output.weight", _quant(rng, QT.Q8_0, (n_embd, n_head * head_dim)), raw_dtype=QT.Q8_0)
        w.add_tensor(p + "attn_q_norm.weight", f32(head_dim))
        w.add_tensor(p + "attn_k_norm.weight", f32(head_dim))
        w.add_tensor(p + "ffn_norm.weight", f32(n_embd))
        if i < dense_lead:  # a leading dense layer (deepseek2-style): a plain FFN, no experts
            w.add_tensor(p + "ffn_gate.weight", _quant(rng, QT.Q8_0, (n_ff, n_embd)), raw_dtype=QT.Q8_0)
            w.add_tensor(p + "ffn_up.weight", _quant(rng, QT.Q8_0, (n_ff, n_embd)), raw_dtype=QT.Q8_0)
            w.add_tensor(p + "ffn_down.weight", _quant(rng, QT.Q8_0, (n_embd, n_ff)), raw_dtype=QT.Q8_0)
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", f32(n_expert, n_embd))
        w.add_tensor(p + "ffn_gate_exps.weight", _quant(rng, expert_qtype, (n_expert, n_ff, n_embd)), raw_dtype=expert_qtype)
        w.add_tensor(p + "ffn_up_exps.weight", _quant(rng, expert_qtype, (n_expert, n_ff, n_embd)), raw_dtype=expert_qtype)
        w.add_tensor(p + "ffn_down_exps.weight", _quant(rng, expert_qtype, (n_expert, n_embd, n_ff)), raw_dtype=expert_qtype)
    w.add_tensor("output_norm.weight", f32(n_embd))
    w.add_tensor("output.weight", _quant(rng, QT.Q8_0, (vocab, n_embd)), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-00001-of-*.gguf"))[0]
    return path


def tensor_info_field(path: Path, name: str):
    """(offset of the tensor's info record, its parts) as gguf-py parsed them."""
    r = GGUFReader(path)
    for t in r.tensors:
        if t.name == name:
            return t.field
    raise KeyError(name)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def patch_tensor_info(path: Path, name: str, *, raw_type: int | None = None, rel_offset: int | None = None) -> None:
    """Overwrite a tensor's ggml type id or data offset inside its info record."""
    field = tensor_info_field(path, name)
    name_len, name_data, n_dims, dims, raw_dtype, offset_tensor = field.parts
    type_at = field.offset + name_len.nbytes + name_data.nbytes + n_dims.nbytes + dims.nbytes
    if raw_type is not None:
        patch(path, type_at, int(raw_type).to_bytes(4, "little"))
    if rel_offset is not None:
        patch(path, type_at + 4, int(rel_offset).to_bytes(8, "little"))


def with_metadata(src: Path, dst: Path, changes: dict) -> Path:
    """`src` copied to `dst` with some metadata keys replaced: `changes` maps a key to
    (value, GGUFValueType). Tensors and every other key stay as they are."""
    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in changes:
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for key, (value, vtype) in changes.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_nextn_block(src: Path, dst: Path) -> Path:
    """`src` with a NextN/MTP block appended as llama.cpp's loaders read one (e.g. a
    deepseek2-arch GLM-4.7-Flash file): block L (L = the decoder's layers) is a copy of the
    last layer's tensors plus nextn.eh_proj [D, 2D] and the enorm / hnorm / shared_head_norm
    norms, block_count is L + 1 and nextn_predict_layers 1."""
    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    n = int(r.fields[f"{arch}.block_count"].contents())
    d = int(r.fields[f"{arch}.embedding_length"].contents())
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", f"{arch}.block_count"):
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    w.add_block_count(n + 1)
    w.add_nextn_predict_layers(1)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    last = f"blk.{n - 1}."
    for t in r.tensors:
        if t.name.startswith(last):
            w.add_tensor(f"blk.{n}." + t.name[len(last) :], np.asarray(t.data), raw_dtype=t.tensor_type)
    rng = np.random.default_rng(0)
    w.add_tensor(f"blk.{n}.nextn.eh_proj.weight", (rng.standard_normal((d, 2 * d)) / np.sqrt(2 * d)).astype(np.float32))
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        w.add_tensor(f"blk.{n}.nextn.{norm}.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_nvfp4_dequantized(src: Path, dst: Path) -> Path:
    """`src` with every NVFP4 tensor written as F32, its values gguf-py's dequantizer's times its
    `.scale` sidecar (one a tensor, or one an expert), and the sidecars (`.scale`,
    `.input_scale`) left out: the model the NVFP4 file means, computed with no NVFP4 code of ours."""
    from gguf.quants import dequantize

    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    by_name = {t.name: t for t in r.tensors}
    stems = [t.name.removesuffix(".weight") for t in r.tensors if t.tensor_type == QT.NVFP4]
    sidecars = {stem + suffix for stem in stems for suffix in (".scale", ".input_scale")}
    for t in r.tensors:
        if t.name in sidecars:
            continue
        if t.tensor_type != QT.NVFP4:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = dequantize(np.asarray(t.data), QT.NVFP4).astype(np.float32)  # numpy shape, last axis ne0
        sidecar = by_name.get(t.name.removesuffix(".weight") + ".scale")
        if sidecar is not None:
            scale = np.asarray(sidecar.data, np.float32).reshape(-1)
            values = values * (scale.reshape(-1, 1, 1) if values.ndim == 3 else scale[0])
        w.add_tensor(t.name, np.ascontiguousarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
