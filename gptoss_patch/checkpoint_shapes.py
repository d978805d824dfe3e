"""The tensors a GPT-OSS checkpoint holds, read from its ``config.json`` and safetensors *headers* (no tensor data).

Used at model build by the guard (:func:`gptoss_patch.patches.guard.check_checkpoint`, so that a wrong-shaped tensor
stops ``vllm serve`` naming it instead of failing deep in vLLM's loader) and by the operations kit's checkpoint report
(:mod:`gptoss_patch.ops.checkpoint`). Standard library plus ``safetensors`` (imported when headers are read), below
the patches: nothing here imports vLLM or the rest of gptoss_patch.

The layout is the one transformers' ``GptOssForCausalLM.save_pretrained`` writes (``models/gpt_oss/
modeling_gpt_oss.py``, transformers 4.57), which the BF16 releases (``unsloth/gpt-oss-*-BF16``) use; the names are
written by :mod:`gptoss_patch.testing.tiny`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REQUIRED_CONFIG", "expected_tensors", "read_headers", "mismatched", "mismatched_shapes"]

#: ``config.json`` keys the tensor shapes follow from (each a positive int).
REQUIRED_CONFIG = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "num_local_experts", "vocab_size")


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a BF16 GPT-OSS checkpoint with ``config`` must hold.

    ``config``: the parsed ``config.json`` (needs the keys of ``REQUIRED_CONFIG``; ``head_dim``
    defaults to ``hidden_size // num_attention_heads``, ``tie_word_embeddings`` to False). Layout as
    written by transformers' ``GptOssForCausalLM.save_pretrained`` (names in :mod:`gptoss_patch.testing.tiny`).
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
    from safetensors import SafetensorError, safe_open

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
            with safe_open(str(path), framework="numpy") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    found[key] = (name, tuple(piece.get_shape()), str(piece.get_dtype()))
        except (SafetensorError, OSError, ValueError) as exc:
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
        ImportError: the ``safetensors`` package is missing.
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
