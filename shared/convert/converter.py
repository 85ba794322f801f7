"""`moe-pipe convert`: a Hugging Face checkpoint -> a GGUF file llama.cpp and moe-pipe can run.

Supported model types: every `hf_model_types` of the family registry
(shared/family_registry.py); of a multimodal config only the text model is
converted. The output uses llama.cpp's tensor names, shapes and metadata keys
(docs/models.md § From Hugging Face names). Each family's rules are its convert
part (shared/families/<family>/convert.py, found through rules.py and built from
the blocks in plan.py); the tokenizer is copied by vocab.py, the safetensors
read by source.py (those in shared/convert/).

Types (`outtype`): f32 keeps every tensor F32. Otherwise weight matrices
(2-D and up) take the type, while norms, biases, routers (`ffn_gate_inp`),
sinks, scales and other 1-D tensors stay F32, as llama.cpp's converter does;
for q8_0 a matrix whose rows are not a multiple of 32 wide falls back to F16.
MXFP4 experts of a gpt-oss checkpoint are repacked losslessly and stay MXFP4.

The NextN/MTP block (Qwen3.5/3.6's `mtp.*`, GLM-4.5's `model.layers.{L..}`) is written
after the decoder's layers when the checkpoint has it, as llama.cpp's converter does by
default (`block_count` counts it, `nextn_predict_layers` says how many); `mtp=False`
(`--no-mtp`, llama.cpp's flag too) leaves it out. A family's plan reads the wish as
`hp["mtp"]`; its metadata reads what was planned as `hp["mtp_written"]`.

Writing streams: the tensor table goes into the header first, then one tensor
at a time is converted from memory-mapped safetensors and written, so peak
RAM is about one output tensor. The file is written to `<out>.part` and
renamed when complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, LlamaFileType
from gguf.quants import quantize

from ..errors import UserError
from ..quant.blocks import block_format
from .plan import Out, mtp_blocks
from .rules import arch_for
from .source import Checkpoint, read_json
from .vocab import add_vocab, read_vocab

__all__ = ["OUTTYPES", "convert", "tensor_qtype"]

OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
_FILE_TYPE = {
    Q.F32: LlamaFileType.ALL_F32,
    Q.F16: LlamaFileType.MOSTLY_F16,
    Q.BF16: LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: LlamaFileType.MOSTLY_Q8_0,
}


def convert(
    hf_dir: Path | str,
    out: Path | str,
    outtype: str = "f16",
    progress: Callable[[int, int], None] | None = None,
    mtp: bool = True,
) -> Path:
    """Convert the HF model in `hf_dir` to a GGUF at `out`; returns `out`.

    `mtp`: write the checkpoint's NextN/MTP block, if it has one (module docstring).

    `progress(bytes_done, bytes_total)` is called after each tensor (output
    tensor bytes, header excluded). Any problem with the input is a one-line
    UserError naming the file, key or tensor.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    qtype = OUTTYPES.get(str(outtype).lower())
    if qtype is None:
        raise UserError(f"--outtype {outtype!r} is not supported; choose one of {', '.join(OUTTYPES)}")
    cfg_path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: not a directory (expected a Hugging Face model folder)")
    if not cfg_path.is_file():
        raise UserError(f"{hf_dir}: config.json is missing; is this a Hugging Face model folder?")
    config = read_json(cfg_path)
    arch = arch_for(config, cfg_path)
    hp = {**arch.hparams(arch.text_config(config)), "mtp": mtp}
    vocab = read_vocab(hf_dir, arch.gguf_arch, hp["V"], config)

    ck = Checkpoint(hf_dir)
    try:
        plan = arch.plan(hp, ck)  # checks every name and shape before writing anything
        hp = {**hp, "mtp_written": mtp_blocks(plan, hp["L"])}
        types = [tensor_qtype(o, qtype) for o in plan]
        sizes = [_tensor_bytes(o.shape, t) for o, t in zip(plan, types)]
        total = sum(sizes)
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if total > free:
            raise UserError(f"{out}: the converted model needs {total / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free there")
        part = out.with_name(out.name + ".part")
        w = GGUFWriter(part, arch.gguf_arch)
        try:
            _add_general(w, hf_dir, config, qtype, any(t == Q.MXFP4 for t in types))
            arch.metadata(w, hp)
            add_vocab(w, vocab)
            for o, t, n in zip(plan, types, sizes):
                w.add_tensor_info(o.name, _byte_shape(o.shape, t), np.dtype(np.uint8), n, raw_dtype=t)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            done = 0
            if progress:
                progress(0, total)
            for o, t, n in zip(plan, types, sizes):
                w.write_tensor_data(_encode(o, t, n))
                done += n
                if progress:
                    progress(done, total)
            w.close()
            os.replace(part, out)
        except BaseException:
            w.close()
            part.unlink(missing_ok=True)
            raise
    finally:
        ck.close()
    return out


def tensor_qtype(o: Out, outtype: Q) -> Q:
    """The ggml type tensor `o` gets under `outtype` (llama.cpp's converter rules)."""
    if o.raw_qtype is not None:
        return o.raw_qtype
    if not o.matrix or outtype == Q.F32:
        return Q.F32
    if outtype == Q.Q8_0 and o.shape[-1] % block_format(Q.Q8_0).block_size:
        return Q.F16
    return outtype


def _byte_shape(shape: tuple[int, ...], t: Q) -> tuple[int, ...]:
    if t == Q.I32:  # an index table (deepseek4's token → experts): 4 bytes a value, written raw
        return (*shape[:-1], 4 * shape[-1])
    return (*shape[:-1], block_format(t).row_bytes(shape[-1]))


def _tensor_bytes(shape: tuple[int, ...], t: Q) -> int:
    return int(np.prod(_byte_shape(shape, t))) if t == Q.I32 else block_format(t).tensor_bytes(shape)


def _encode(o: Out, t: Q, nbytes: int) -> np.ndarray:
    """The tensor's bytes, shaped (..., row_bytes), built one part (expert) at a time."""
    buf = np.empty(nbytes, np.uint8)
    pos = 0
    for part in o.parts():
        if o.raw_qtype is not None:
            b = np.ascontiguousarray(part, np.uint8).reshape(-1)
        else:
            x = np.ascontiguousarray(part, np.float32)
            b = (x if t == Q.F32 else quantize(x, t)).view(np.uint8).reshape(-1)
        if pos + b.size > nbytes:
            raise AssertionError(f"{o.name}: parts exceed {nbytes} bytes")
        buf[pos : pos + b.size] = b
        pos += b.size
    if pos != nbytes:
        raise AssertionError(f"{o.name}: parts gave {pos} of {nbytes} bytes")
    return buf.reshape(_byte_shape(o.shape, t))


def _add_general(w: GGUFWriter, hf_dir: Path, config: dict, qtype: Q, mxfp4: bool) -> None:
    w.add_name(hf_dir.resolve().name)
    w.add_description(f"converted by moe-pipe convert from a Hugging Face {config.get('model_type')} checkpoint")
    w.add_file_type(int(LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else _FILE_TYPE[qtype]))
    w.add_quantization_version(2)
