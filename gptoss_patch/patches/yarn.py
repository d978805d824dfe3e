"""Rope: honour GPT-OSS's YaRN ``truncate: false`` in vllm-ascend's YaRN rotary embedding.

Why
    GPT-OSS sets ``rope_scaling.truncate = false`` (the reference model does not round the YaRN
    correction range; :mod:`gptoss_patch.kernels.rope`). vLLM 0.11 always rounds, so the rotary
    cos/sin of every GPT-OSS layer differ from the model's by up to 2.69 (measured on head_dim 64 over all 131072
    positions: the phase error grows with the position until signs flip; cos/sin are scaled by mscale 1.35),
    enough to change greedy tokens. vLLM >= 0.12 passes ``truncate=`` to the rotary class, but
    vllm-ascend's ``AscendYaRNRotaryEmbedding.__init__`` (registered out-of-tree for
    ``YaRNScalingRotaryEmbedding``) has no such parameter until 0.15.0rc1, so model construction
    fails with an unexpected keyword (docs/upstream.md §7.6, §8.1).
How
    A wrapt wrapper around ``AscendYaRNRotaryEmbedding.__init__`` pops ``truncate`` (vLLM >= 0.12);
    on vLLM 0.11, which does not pass it, it reads ``rope_scaling.truncate`` of a ``gpt_oss`` model
    from the current vLLM config (other models: unchanged). When ``truncate`` is False it recomputes
    the ``cos_sin_cache`` buffer with the unrounded correction range, same dtype and device, and sets
    ``self.truncate``. vLLM >= 0.12's own ``YaRNScalingRotaryEmbedding`` has ``truncate`` (default True), but the
    Ascend class calls its parent without it, so the parent's cache is the rounded one: the recomputation is needed
    in every release up to 0.14.0rc1. From 0.13.0rc1 the Ascend ``__init__`` also records the first rope's cache
    in the module global ``_cos_sin_cache``; the wrapper re-points it at the recomputed cache.
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.14.0rc1 (vLLM 0.11.0 ... 0.14.1). 0.15.0rc1 accepts ``truncate`` and hands it to
    vLLM's YaRN, which honours it (its comment "current not support actual truncate" is out of date:
    docs/upstream.md §4.9).
Remove when
    the oldest supported release is 0.15.0rc1 (its YaRN class honours ``truncate``).
"""

from __future__ import annotations

from typing import Any

from gptoss_patch.evidence import LOGGER_NAME  # under vLLM's logger: the lines show in the server's output
from gptoss_patch.registry import PatchSpec


def _truncate_from_model_config() -> bool | None:
    """``rope_scaling.truncate`` of the GPT-OSS model being built, or None (not GPT-OSS / not set)."""
    try:
        from vllm.config import get_current_vllm_config

        hf = get_current_vllm_config().model_config.hf_config
    except Exception as exc:  # noqa: BLE001 - no current config (a rope built outside model construction)
        import logging

        logging.getLogger(LOGGER_NAME).warning(
            "gptoss-patch: YaRN rope built without a current vLLM model config (%s); truncate left as upstream's", exc)
        return None
    if getattr(hf, "model_type", None) != "gpt_oss":
        return None
    scaling = getattr(hf, "rope_scaling", None) or {}
    value = scaling.get("truncate")
    return None if value is None else bool(value)


def recompute_untruncated(rope: Any) -> None:
    """Replace ``rope.cos_sin_cache`` ``[max_pos, rotary_dim]`` by the ``truncate=False`` YaRN cache (in place)."""
    import torch

    from gptoss_patch.kernels.rope import yarn_inv_freq

    inv = yarn_inv_freq(base=rope.base, rotary_dim=rope.rotary_dim, scaling_factor=rope.scaling_factor,
                        beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                        max_position_embeddings=rope.max_position_embeddings,
                        extrapolation_factor=rope.extrapolation_factor, truncate=False)
    t = torch.arange(rope.max_position_embeddings * rope.scaling_factor, dtype=torch.float32)
    freqs = torch.einsum("i,j -> ij", t, inv)
    cache = torch.cat((freqs.cos() * rope.mscale, freqs.sin() * rope.mscale), dim=-1)
    old = rope.cos_sin_cache
    rope.cos_sin_cache = cache.to(dtype=old.dtype, device=old.device)


def _rerecord(rope: Any, old: Any) -> None:
    """vllm-ascend 0.13.0rc1+ ``AscendYaRNRotaryEmbedding.__init__`` ends with
    ``_record_cos_sin_cache(self.cos_sin_cache)``: the first rope built keeps its cache in the module global
    ``_cos_sin_cache``, from which ``update_cos_sin`` fills the cos/sin slices that ``_rope_forward_oot`` uses for head
    size 128. If that global is the cache just replaced, point it at the new one (0.11.x / 0.12.0rc1 have no such
    global: nothing to do)."""
    import sys

    module = sys.modules.get(type(rope).__module__)
    if module is not None and getattr(module, "_cos_sin_cache", None) is old:
        module._cos_sin_cache = rope.cos_sin_cache


def _yarn_init(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendYaRNRotaryEmbedding.__init__``: accept and honour ``truncate``."""
    truncate = kwargs.pop("truncate", None)
    result = wrapped(*args, **kwargs)
    if truncate is None:
        truncate = _truncate_from_model_config()
    instance.truncate = True if truncate is None else bool(truncate)
    if truncate is False:
        old = instance.cos_sin_cache
        recompute_untruncated(instance)
        _rerecord(instance, old)
    return result


PATCHES = [
    PatchSpec(
        name="yarn.truncate",
        target_key="yarn_rope_init",
        wrapper=_yarn_init,
        params=("head_size", "rotary_dim", "max_position_embeddings", "base", "is_neox_style", "scaling_factor",
                "dtype", "beta_fast", "beta_slow"),
        absent_params=("truncate",),
        summary="AscendYaRNRotaryEmbedding honours GPT-OSS's rope_scaling.truncate=false",
    ),
]
