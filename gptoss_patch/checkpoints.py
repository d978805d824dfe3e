"""GPT-OSS checkpoints, read from ``config.json`` and the safetensors *headers* (no tensor data): BF16 and MXFP4.

Used at model build by the guard (:func:`gptoss_patch.patches.guard.check_checkpoint`, so that a wrong-shaped tensor
stops ``vllm serve`` naming it instead of failing deep in vLLM's loader) and by the operations kit's checkpoint report
(:mod:`gptoss_patch.tools.checkpoint`); the MXFP4 file checks of the official checkpoints (:func:`check_files`) for
both. One safetensors header reader (:func:`safetensors_header`, standard library only: no ``safetensors``, no torch),
below the patches: nothing here imports vLLM or the rest of gptoss_patch at module level.

The layout is the one transformers' ``GptOssForCausalLM.save_pretrained`` writes (``models/gpt_oss/
modeling_gpt_oss.py``, transformers 4.57), which the BF16 releases (``unsloth/gpt-oss-*-BF16``) use; the names are
written by :mod:`gptoss_patch.selftest.tiny`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["REQUIRED_CONFIG", "expected_tensors", "read_headers", "mismatched", "mismatched_shapes", "safetensors_header",
           "layout_problem", "check_files", "is_gpt_oss_mxfp4", "quant_method", "mxfp4_shapes", "Mxfp4CheckpointError"]

#: ``config.json`` keys the tensor shapes follow from (each a positive int).
REQUIRED_CONFIG = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "num_local_experts", "vocab_size")


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a BF16 GPT-OSS checkpoint with ``config`` must hold.

    ``config``: the parsed ``config.json`` (needs the keys of ``REQUIRED_CONFIG``; ``head_dim``
    defaults to ``hidden_size // num_attention_heads``, ``tie_word_embeddings`` to False). Layout as
    written by transformers' ``GptOssForCausalLM.save_pretrained`` (names in :mod:`gptoss_patch.selftest.tiny`).
    Raises ``KeyError`` naming a missing config key.
    """
    for key in REQUIRED_CONFIG:
        if key not in config:
            raise KeyError(key)
    h, i, e, v = (config["hidden_size"], config["intermediate_size"], config["num_local_experts"],
                  config["vocab_size"])
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nq
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.q_proj.bias": (nq * d,),
            p + "self_attn.k_proj.weight": (nkv * d, h), p + "self_attn.k_proj.bias": (nkv * d,),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.v_proj.bias": (nkv * d,),
            p + "self_attn.o_proj.weight": (h, nq * d), p + "self_attn.o_proj.bias": (h,),
            p + "self_attn.sinks": (nq,),
            p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
            p + "mlp.experts.gate_up_proj": (e, h, 2 * i), p + "mlp.experts.gate_up_proj_bias": (e, 2 * i),
            p + "mlp.experts.down_proj": (e, i, h), p + "mlp.experts.down_proj_bias": (e, h),
        })
    return shapes


def read_headers(directory: Path, problems: list[str]):
    """``(found, unavailable, assignment)`` from the safetensors headers of ``directory``, or None when there is
    nothing to read; each problem found (a missing or unreadable shard, a bad index, a tensor in the wrong shard) is
    appended to ``problems`` as one line naming the file and the tensor.

    ``found``: name -> (file name, shape, dtype); ``unavailable``: files missing or unreadable;
    ``assignment``: the index's weight_map (None without an index).
    """
    index = directory / "model.safetensors.index.json"
    assignment: dict[str, str] | None = None
    if index.is_file():
        try:
            assignment = json.loads(index.read_text())["weight_map"]
            if not isinstance(assignment, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); expected "
                                   "JSON with a 'weight_map' object of tensor name -> shard file")
            return None
        files = sorted(set(assignment.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        problems.append(f"{directory}: no *.safetensors files (expected model.safetensors or shards "
                               "listed by model.safetensors.index.json)")
        return None
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    unavailable: set[str] = set()
    for name in files:
        path = directory / name
        if not path.is_file():
            unavailable.add(name)
            named = sum(1 for f in (assignment or {}).values() if f == name)
            problems.append(f"{path}: missing (model.safetensors.index.json assigns {named} tensors to it)")
            continue
        try:
            header, available = safetensors_header(path)
            tensors = list(_tensors(header))
            problem = layout_problem(tensors, available)
            if problem:
                raise ValueError(problem)
            for key, shape, dtype, _ in tensors:
                found[key] = (name, shape, dtype)
        except (OSError, ValueError) as exc:
            unavailable.add(name)
            problems.append(f"{path}: unreadable safetensors header ({exc}); the file is truncated or "
                                   "corrupt - download it again")
    if assignment is not None:
        for key, name in sorted(assignment.items()):
            if key in found and found[key][0] != name:
                problems.append(f"{directory / name}: index assigns tensor {key} to this file but it is in "
                                       f"{found[key][0]}")
            elif key not in found and name not in unavailable:
                problems.append(f"{directory / name}: tensor {key} listed in model.safetensors.index.json "
                                       "is not in this file")
    return found, unavailable, assignment


def mismatched(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[str, tuple[int, ...], str]]) -> list[str]:
    """Names of the tensors present in ``found`` (from :func:`read_headers`) whose shape is not ``expected``'s, in
    the order of ``expected``."""
    return [k for k in expected if k in found and found[k][1] != expected[k]]


def mismatched_shapes(directory) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """The tensors of the GPT-OSS checkpoint in ``directory`` whose shape differs from what its config implies.

    Reads ``config.json``, ``model.safetensors.index.json`` (if any) and the safetensors *headers* only (no tensor
    data), and compares exactly as the operations kit's checkpoint report does (the expected shapes of :func:`expected_tensors`,
    the layout transformers' ``GptOssForCausalLM`` saves). Missing tensors, unreadable or missing shards and the
    other checks of the operations kit's checkpoint report are not reported here (tensors of an unreadable shard are not compared).

    Args:
        directory: the checkpoint directory (str or path).

    Returns:
        ``[(name, shape, expected)]`` with ``shape``/``expected`` tuples of ints, in the order of
        :func:`expected_tensors` (layer by layer); empty when every present tensor has its expected shape.
        E.g. ``[("model.layers.0.self_attn.sinks", (8, 1), (8,))]``.

    Raises:
        FileNotFoundError: no ``directory/config.json``.
        ValueError: ``config.json`` is not a JSON object, or lacks (or has non-positive-int) geometry keys
            (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``num_local_experts``, ``vocab_size``); the message names the file.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: top level is not an object")
    bad = [k for k in REQUIRED_CONFIG if not isinstance(config.get(k), int) or config.get(k) < 1]
    if bad:
        raise ValueError(f"{config_path}: missing or non-positive {', '.join(bad)}")
    expected = expected_tensors(config)
    headers = read_headers(directory, [])
    if headers is None:
        return []
    found = headers[0]
    return [(k, found[k][1], expected[k]) for k in mismatched(expected, found)]


# ------------------------------------------------------------------------------------------------------ one reader

#: The largest header the safetensors library reads (``MAX_HEADER_SIZE`` in safetensors' ``tensor.rs``): a length
#: above it is a corrupt file, not a reason to read gigabytes.
MAX_HEADER_BYTES = 100_000_000

#: Bits per element of the safetensors dtypes (safetensors' ``Dtype``, each checked to open with safetensors 0.8's
#: ``safe_open``; sub-byte ones pack, so a tensor's bits must fill whole bytes).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E5M2FNUZ": 8, "F8_E4M3FNUZ": 8,
              "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64,
              "F64": 64, "I64": 64, "U64": 64}


def safetensors_header(path) -> tuple[dict, int]:
    """The JSON header of one safetensors file and the bytes of tensor data the file holds after it (the format:
    an 8-byte little-endian header length, the JSON header, the data; ``data_offsets`` are relative to the data).
    Standard library only; reads the header (at most :data:`MAX_HEADER_BYTES`), never the data. The tensors' layout
    is judged by :func:`layout_problem`.

    Raises:
        ValueError: the file is shorter than its header says, the header is larger than :data:`MAX_HEADER_BYTES`, or
            it is not a JSON object (the message says which; the callers name the file).
        OSError: the file cannot be read.
    """
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{size} bytes, no header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"header of {n} bytes: more than the {MAX_HEADER_BYTES} safetensors reads")
        if 8 + n > size:
            raise ValueError(f"header of {n} bytes, file of {size}")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, size - 8 - n


def _tensors(header: dict):
    """``(name, shape, dtype, (begin, end))`` of every tensor of a safetensors header (``__metadata__`` skipped).

    Raises:
        ValueError: an entry whose ``shape`` is not a list of non-negative integers, whose ``dtype`` is not a string,
            or whose ``data_offsets`` are not two integers ``0 <= begin <= end``."""
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(dtype, str):
            raise ValueError(f"tensor {name}: dtype {dtype!r} is not a string")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name}: data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
        yield name, tuple(shape), dtype, (offsets[0], offsets[1])


def layout_problem(tensors, available: int) -> str | None:
    """What makes a file's tensor layout invalid, as the safetensors library judges it (``Metadata::validate``), or
    None: an unknown dtype; a tensor whose bytes are not its shape times its dtype's size; tensors that overlap or
    leave a hole (sorted by offset, each begins where the previous ended, the first at 0); data that does not end
    exactly at the end of the file (``available`` bytes after the header: shorter is a truncated download).

    ``tensors``: the tuples of :func:`_tensors`."""
    at = 0
    for name, shape, dtype, (begin, end) in sorted(tensors, key=lambda x: x[3]):
        if dtype not in DTYPE_BITS:
            return f"tensor {name}: unknown dtype {dtype!r}"
        count = 1
        for d in shape:
            count *= d
        bits = count * DTYPE_BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            return f"tensor {name}: {end - begin} bytes for shape {list(shape)} {dtype}"
        if begin != at:
            return f"tensor {name}: data begins at byte {begin}, the previous tensor ends at {at}"
        at = end
    if at != available:
        return f"the header places {at} bytes of tensor data, the file holds {available}"
    return None


def _raw_headers(directory: str) -> dict[str, tuple[str, tuple[int, ...], str, int, int]]:
    """name -> (file, shape, dtype, data end offset, bytes available) for every tensor of every safetensors file of
    ``directory`` (:func:`safetensors_header`); a truncated data part is the caller's to judge.

    Raises:
        Mxfp4CheckpointError: a file too short to hold its own header, or an unreadable header."""
    out = {}
    for fname in sorted(os.listdir(directory)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(directory, fname)
        try:
            header, available = safetensors_header(path)
            for name, shape, dtype, (_, end) in _tensors(header):
                out[name] = (path, shape, dtype, end, available)
        except ValueError as exc:
            raise Mxfp4CheckpointError(f"{path}: truncated safetensors file ({exc})") from None
    return out


# ---------------------------------------------------------------------------------------------------------- MXFP4

class Mxfp4CheckpointError(ValueError):
    """An MXFP4 GPT-OSS checkpoint cannot be dequantized: a tensor is missing, mis-shaped or truncated."""


def quant_method(config: Any) -> str | None:
    """``quantization_config.quant_method`` of an HF config object or ``config.json`` dict (lower case), or None."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                      None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    return str(method).lower() if method is not None else None


def is_gpt_oss_mxfp4(config: Any) -> bool:
    """True for a GPT-OSS config (``model_type == "gpt_oss"``) whose quantization method is ``mxfp4``."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return model_type == "gpt_oss" and quant_method(config) == "mxfp4"


def mxfp4_shapes(config: Any) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{"gate_up_proj"|"down_proj": {"blocks": shape, "scales": shape}}`` an MXFP4 GPT-OSS config implies
    (:func:`gptoss_patch.kernels.mxfp4.expected_shapes`)."""
    from gptoss_patch.kernels.mxfp4 import expected_shapes

    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k))
    E, H, intermediate = get("num_local_experts"), get("hidden_size"), get("intermediate_size")
    return {kind: expected_shapes(kind, E, H, intermediate) for kind in ("gate_up_proj", "down_proj")}


def check_files(directory: str, config: dict | None = None) -> list[str]:
    """Problems of an MXFP4 GPT-OSS checkpoint directory, read from ``config.json`` and the safetensors headers.

    One line per problem, naming the tensor and the expected shape: a ``*_blocks`` without its ``*_scales`` (or the
    reverse), a blocks/scales tensor whose shape or dtype differs from what ``config.json`` implies
    (:func:`gptoss_patch.kernels.mxfp4.expected_shapes`), a tensor whose data ends beyond its file (a truncated
    shard). Empty for a sound checkpoint, or when ``config.json`` is not MXFP4 GPT-OSS.

    Raises:
        Mxfp4CheckpointError: a safetensors file too short to hold its own header.
    """
    if config is None:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    if not is_gpt_oss_mxfp4(config):
        return []
    shapes = mxfp4_shapes(config)
    headers = _raw_headers(directory)
    problems = []
    for name, (path, shape, dtype, end, available) in sorted(headers.items()):
        if end > available:
            want = next((list(s[p]) for k, s in shapes.items() for p in ("blocks", "scales")
                         if name.endswith(f".{k}_{p}")), list(shape))
            problems.append(f"{name}: data ends at byte {end} of {available} in {os.path.basename(path)} (truncated "
                            f"shard); expected shape {want} {dtype}")
    for layer in range(int(config["num_hidden_layers"])):
        for kind, want in shapes.items():
            base = f"model.layers.{layer}.mlp.experts.{kind}"
            got = {p: headers.get(f"{base}_{p}") for p in ("blocks", "scales")}
            if got["blocks"] is None and got["scales"] is None:
                if base in headers:  # a BF16 expert tensor in an MXFP4 checkpoint: loads as it is
                    continue
                problems.append(f"{base}_blocks and {base}_scales missing (expected shapes {list(want['blocks'])} "
                                f"and {list(want['scales'])} uint8)")
                continue
            for part, other in (("blocks", "scales"), ("scales", "blocks")):
                if got[part] is not None and got[other] is None:
                    problems.append(f"{base}_{part} has no {base}_{other} (expected shape {list(want[other])} uint8)")
            for part in ("blocks", "scales"):
                if got[part] is not None and (got[part][1] != want[part] or got[part][2] != "U8"):
                    problems.append(f"{base}_{part}: shape {list(got[part][1])} {got[part][2]}, expected shape "
                                    f"{list(want[part])} U8")
    return problems
