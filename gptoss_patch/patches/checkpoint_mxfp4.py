"""Checkpoint: the official MXFP4 GPT-OSS checkpoints load on Ascend as BF16, dequantized per tensor and per rank.

Why
    ``openai/gpt-oss-20b`` / ``-120b`` ship their MoE experts as MXFP4 (``*_blocks`` uint8 FP4 E2M1 pairs,
    ``*_scales`` E8M0; ``config.json`` ``quantization_config.quant_method: "mxfp4"``). Ascend 910B has no FP4 and no
    vllm-ascend release has an MXFP4 MoE method, so vLLM's ``ModelConfig._verify_quantization`` ends in
    ``NPUPlatform.verify_quantization`` ("mxfp4 quantization is currently not supported in npu": vllm-ascend's
    ``supported_quantization`` is ``ascend`` / ``compressed-tensors``, 0.11.0 ... 0.19.1rc1 ``platform.py``). Users
    fetch a third-party BF16 copy (~240 GB for 120b) instead.
How
    Three ``wrapt`` wrappers on vLLM (same targets in vLLM 0.11.0 ... 0.19.1, :data:`gptoss_patch.matrix.MXFP4_TARGETS`):

    * ``ModelConfig._verify_quantization``: for a ``gpt_oss`` model whose ``quantization_config.quant_method`` is
      ``mxfp4`` (and ``--quantization`` unset or ``mxfp4``), the model is configured unquantized
      (``quantization = None``) instead of running upstream's check - vLLM then builds the unquantized FusedMoE
      (vllm-ascend's ``AscendUnquantizedFusedMoEMethod``, our MoE patches on 0.11-0.14) with BF16 (model dtype)
      parameters, exactly as for a BF16 checkpoint. Every other model runs upstream's check unchanged.
    * ``GptOssModel.load_weights``: upstream dispatches on ``config.quantization_config["quant_method"]`` and would
      take ``_load_weights_mxfp4`` (FP4 parameters). For an MXFP4 GPT-OSS built unquantized, the weight stream is
      rewritten: each layer's ``w13_weight``/``w13_weight_scale`` (``gate_up_proj_blocks``/``_scales`` after
      ``hf_to_vllm_mapper``) and ``w2_weight``/``w2_weight_scale`` pairs become one
      :class:`gptoss_patch.kernels.mxfp4.LazyMxfp4` each - the BF16 checkpoint tensor ``[E, C, R]`` with no storage -
      and upstream's BF16 loader ``_load_weights_other`` runs on that stream (the config it sees for the call has no
      ``quantization_config``). ``_load_weights_other`` slices its rank's part with its own rules (TP ``[:, :,
      2s:2e]`` / ``[:, s:e, :]``, EP ``[a:b]``; DP/PCP flattening from vLLM 0.12), permutes and copies into the
      parameter; only that copy dequantizes, and only the sliced region. Host memory: one pair of the layer's
      blocks/scales (read lazily from the safetensors mmap) and the rank's BF16 slice of one tensor.
      Non-expert tensors (attention, router, norms, embeddings, expert biases, all BF16 in the official files)
      pass through unchanged.

    * ``GptOssForCausalLM.load_weights``: the whole stream. vLLM's ``AutoWeightsLoader`` hands ``GptOssModel`` one
      call per run of ``model.*`` names; when a shard boundary falls between a layer's ``*_blocks`` and ``*_scales``
      and ``lm_head.weight`` sorts between them (safetensors lists a shard's names sorted; ``lm_head`` < ``model``),
      the pair arrives in two calls. The first half waits on the ``GptOssModel`` for the second; after the stream,
      a half still waiting is an error.

    Bad input stops the load with :class:`Mxfp4CheckpointError` naming the tensor and the expected shape: blocks
    without scales (or the reverse) at the end of the stream, blocks/scales of the wrong shape or dtype. Before any
    weight loads, the guard reads the safetensors headers (:func:`gptoss_patch.checkpoints.check_files`): missing partners, wrong shapes and
    shards shorter than their header says (a truncated download) are reported the same way - never a half-loaded
    model. The dequantization equals transformers' ``convert_moe_packed_tensors`` bit for bit
    (:mod:`gptoss_patch.kernels.mxfp4`).
Upstream releases
    vLLM 0.11.0, 0.12.0, 0.13.0, 0.14.1, 0.15.0, 0.16.0, 0.17.0, 0.18.0, 0.19.1 (``vllm/config/model.py``
    ``ModelConfig._verify_quantization``; ``vllm/model_executor/models/gpt_oss.py`` ``GptOssModel.load_weights`` /
    ``GptOssForCausalLM.load_weights`` (``AutoWeightsLoader``, ``vllm/model_executor/models/utils.py``
    ``_groupby_prefix``: ``itertools.groupby`` on the first name part) /
    ``_load_weights_other`` and the ``hf_to_vllm_mapper`` suffixes ``.gate_up_proj_blocks -> .w13_weight``,
    ``.gate_up_proj_scales -> .w13_weight_scale``, ``.down_proj_blocks -> .w2_weight``, ``.down_proj_scales ->
    .w2_weight_scale``); docs/upstream.md "MXFP4 checkpoints".
Remove when
    vllm-ascend loads MXFP4 GPT-OSS itself (not the case in any release up to 0.30.0rc2; issue #7131 closed as
    "use BF16").
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterable, Iterator

from gptoss_patch.checkpoints import Mxfp4CheckpointError, is_gpt_oss_mxfp4, mxfp4_shapes
from gptoss_patch.evidence import LOGGER_NAME  # under vLLM's logger: the lines show in the server's output
from gptoss_patch.registry import PatchSpec

logger = logging.getLogger(LOGGER_NAME)

#: hf_to_vllm_mapper names of the MXFP4 expert tensors (vLLM 0.11.0 ... 0.19.1 ``GptOssForCausalLM``), as the
#: GptOssModel's loader sees them: vLLM name suffix -> (checkpoint tensor, part).
_VLLM_SUFFIXES = {
    ".w13_weight": ("gate_up_proj", "blocks"),
    ".w13_weight_scale": ("gate_up_proj", "scales"),
    ".w2_weight": ("down_proj", "blocks"),
    ".w2_weight_scale": ("down_proj", "scales"),
}


def dequantized_stream(weights: Iterable[tuple[str, Any]], config: Any,
                       pending: dict[str, dict[str, Any]] | None = None) -> Iterator[tuple[str, Any]]:
    """Rewrite a GPT-OSS weight stream (vLLM names, after ``hf_to_vllm_mapper``): each layer's MXFP4 pair becomes one
    BF16 tensor under the blocks' name (``...experts.w13_weight`` ``[E, H, 2I]``, ``...experts.w2_weight``
    ``[E, I, H]``: the BF16 checkpoint layout), as a :class:`gptoss_patch.kernels.mxfp4.LazyMxfp4`; everything else
    passes through in order.

    Args:
        weights: ``(name, tensor)`` pairs; blocks uint8 ``[E, R, G, 16]``, scales uint8 ``[E, R, G]``.
        config: the HF ``GptOssConfig`` (``num_local_experts``, ``hidden_size``, ``intermediate_size``).
        pending: halves of pairs still waiting for their partner, carried from one call to the next. vLLM's
            ``AutoWeightsLoader`` calls ``GptOssModel.load_weights`` once per run of ``model.*`` names, so a pair
            split by a shard boundary with ``lm_head.weight`` between them arrives in two calls; given a dict, the
            halves left at the end stay in it (the caller checks it when the whole stream is done,
            :func:`incomplete_pairs_error`). ``None``: a half left at the end is an error here.

    Raises:
        Mxfp4CheckpointError: a blocks/scales tensor of the wrong shape or dtype (named, with the expected shape), or
            (``pending`` None) at the end of the stream a blocks tensor without its scales (or the reverse).
    """
    import torch

    from gptoss_patch.kernels.mxfp4 import LazyMxfp4, Mxfp4ShapeError, check_pair

    shapes = mxfp4_shapes(config)
    carried = pending is not None
    pending = {} if pending is None else pending
    for name, tensor in weights:
        suffix = next((s for s in _VLLM_SUFFIXES if name.endswith(s)), None)
        if suffix is None or (suffix.endswith("_weight") and tensor.dtype != torch.uint8):
            yield name, tensor  # not an MXFP4 tensor (a BF16 expert weight of a mixed checkpoint passes too)
            continue
        kind, part = _VLLM_SUFFIXES[suffix]
        base = name[: -len(suffix)]
        slot = pending.setdefault(base + "|" + kind, {"kind": kind, "name": base + (
            ".w13_weight" if kind == "gate_up_proj" else ".w2_weight")})
        slot[part] = tensor
        if "blocks" in slot and "scales" in slot:
            del pending[base + "|" + kind]
            label = _hf_name(base, kind)
            try:
                check_pair(label, slot["blocks"], slot["scales"], shapes[kind])
            except Mxfp4ShapeError as exc:
                raise Mxfp4CheckpointError(str(exc)) from None
            yield slot["name"], LazyMxfp4.create(slot["blocks"], slot["scales"])
    if pending and not carried:
        raise incomplete_pairs_error(pending, config)


def incomplete_pairs_error(pending: dict[str, dict[str, Any]], config: Any) -> Mxfp4CheckpointError:
    """The error for halves of MXFP4 pairs still unpaired when the weight stream ended: each named with the tensor it
    lacks and that tensor's expected shape (``pending`` as :func:`dequantized_stream` keeps it)."""
    shapes = mxfp4_shapes(config)
    lines = []
    for slot in pending.values():
        have = "blocks" if "blocks" in slot else "scales"
        miss = "scales" if have == "blocks" else "blocks"
        label = _hf_name(slot["name"].rsplit(".", 1)[0], slot["kind"])
        lines.append(f"{label}_{have} has no {label}_{miss} (expected shape {list(shapes[slot['kind']][miss])} "
                     "uint8)")
    return Mxfp4CheckpointError("MXFP4 GPT-OSS checkpoint incomplete, nothing was served: " + "; ".join(lines))


def _hf_name(vllm_base: str, kind: str) -> str:
    """``model.layers.L.mlp.experts`` + kind -> the checkpoint's ``model.layers.L.mlp.experts.<kind>``."""
    return f"{vllm_base}.{kind}"


def _without_quantization(config: Any) -> Any:
    clone = copy.copy(config)
    clone.__dict__.pop("quantization_config", None)
    if hasattr(clone, "quantization_config"):
        raise RuntimeError(f"{type(config).__name__} keeps a quantization_config attribute that gptoss-patch cannot "
                           "hide from vLLM's GPT-OSS loader")
    return clone


def _experts_unquantized(model: Any) -> bool:
    """True when ``model``'s MoE expert weights are floating point (built unquantized by our config patch)."""
    for name, param in model.named_parameters():
        if name.endswith(".w13_weight"):
            return param.dtype.is_floating_point
    return False


def _verify_quantization(wrapped, instance, args, kwargs):
    """wrapt wrapper for vLLM ``ModelConfig._verify_quantization``: an MXFP4 GPT-OSS is configured unquantized."""
    hf_config = getattr(instance, "hf_config", None)
    if hf_config is not None and is_gpt_oss_mxfp4(hf_config) and getattr(instance, "quantization", None) in (None,
                                                                                                         "mxfp4"):
        instance.quantization = None
        logger.info("gptoss-patch: MXFP4 GPT-OSS checkpoint: experts are dequantized to BF16 while loading "
                    "(Ascend has no FP4)")
        return None
    return wrapped(*args, **kwargs)


#: Attribute of a ``GptOssModel`` that holds the halves of MXFP4 pairs between two of its ``load_weights`` calls.
_PENDING = "_gptoss_patch_mxfp4_pending"


def _load_weights(wrapped, instance, args, kwargs):
    """wrapt wrapper for vLLM ``GptOssModel.load_weights(weights)``: MXFP4 pairs streamed as lazy BF16 tensors into
    upstream's BF16 loader (see the module docstring). A half whose partner is not in this call waits on the model
    for the next call (:data:`_PENDING`); :func:`_check_pairs_complete` refuses what is left at the end."""
    config = getattr(instance, "config", None)
    if config is None or not is_gpt_oss_mxfp4(config) or not _experts_unquantized(instance):
        return wrapped(*args, **kwargs)
    weights = args[0] if args else kwargs.pop("weights")
    pending = instance.__dict__.setdefault(_PENDING, {})
    stream = dequantized_stream(weights, config, pending)
    instance.config = _without_quantization(config)
    try:
        loaded = wrapped(stream, *args[1:], **kwargs)
    finally:
        instance.config = config
    from gptoss_patch import evidence

    evidence.first_use("mxfp4", "MXFP4 experts dequantized to BF16 while loading")
    return loaded


def _check_pairs_complete(wrapped, instance, args, kwargs):
    """wrapt wrapper for vLLM ``GptOssForCausalLM.load_weights(weights)``, the whole checkpoint stream: after it, no
    half of an MXFP4 pair may still wait for its partner (:data:`_PENDING` on ``instance.model``) - raised as
    :class:`Mxfp4CheckpointError` naming each missing tensor and its expected shape."""
    model = getattr(instance, "model", None)
    if model is not None:
        model.__dict__.pop(_PENDING, None)  # a fresh stream
    loaded = wrapped(*args, **kwargs)
    pending = model.__dict__.pop(_PENDING, None) if model is not None else None
    if pending:
        raise incomplete_pairs_error(pending, model.config)
    return loaded


PATCHES = [
    PatchSpec(
        name="checkpoint_mxfp4.unquantized_config",
        target_key="mxfp4_verify_quantization",
        wrapper=_verify_quantization,
        summary="an MXFP4 GPT-OSS checkpoint is configured unquantized (BF16 experts), not rejected on NPU",
    ),
    PatchSpec(
        name="checkpoint_mxfp4.dequantize_load",
        target_key="mxfp4_load_weights",
        wrapper=_load_weights,
        params=("weights",),
        defect_present=('quant_method == "mxfp4"', "_load_weights_other"),
        summary="MXFP4 expert tensors dequantized to BF16 per rank slice as vLLM's BF16 GPT-OSS loader reads them",
    ),
    PatchSpec(
        name="checkpoint_mxfp4.pairs_across_shards",
        target_key="mxfp4_causal_lm_load_weights",
        wrapper=_check_pairs_complete,
        params=("weights",),
        # the stream goes through AutoWeightsLoader, which calls GptOssModel.load_weights once per run of model.*
        defect_present=("AutoWeightsLoader",),
        summary="an MXFP4 pair split by a shard boundary (lm_head.weight between its halves) loads; a half still "
                "unpaired when the checkpoint ends stops the load, named",
    ),
]
