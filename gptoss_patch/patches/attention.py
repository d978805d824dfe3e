"""Attention: keep GPT-OSS's learned attention sinks (and route sink/window layers to our path).

Why
    vLLM's ``Attention`` passes ``sinks=<nn.Parameter [num_heads_per_rank]>`` to the backend impl
    (``vllm/attention/layer.py``: ``impl_cls(..., **extra_impl_args)``). vllm-ascend 0.11.0rc1 -
    0.14.0rc1 ``AscendAttentionBackendImpl.__init__`` ends with ``**kwargs`` and never reads it,
    so the sinks vanish and GPT-OSS attention silently computes a plain softmax
    (upstream_targets.md §2, §4.1; vllm-ascend issue #4283).
How
    A wrapt wrapper around ``AscendAttentionBackendImpl.__init__`` pops ``sinks`` from the
    keyword arguments, calls the original, validates the tensor and stores the *same object* as
    ``self.sinks`` (it is the model's parameter; the weight loader fills it later, so it must not be
    copied). Layers without sinks get ``self.sinks = None`` and run upstream's code unchanged.
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.14.0rc1 (layout rows in :mod:`gptoss_patch.matrix`). 0.15.0rc1
    added the parameter natively (``sinks: torch.Tensor = None``); the structural check refuses a
    target that already has it.
Remove when
    the oldest supported vllm-ascend is >= 0.15.0rc1.
"""

from __future__ import annotations

from typing import Any

from gptoss_patch.registry import PatchSpec


def validate_sinks(sinks: Any, num_heads: int, where: str) -> Any:
    """Check a GPT-OSS sink tensor and return it unchanged (same object).

    Args:
        sinks: ``torch.Tensor``/``nn.Parameter`` of shape ``[num_heads]`` (query heads on this
            tensor-parallel rank), floating dtype (bf16 in the checkpoints; fp16/fp32 accepted).
            One logit per query head, unscaled, joined to the softmax denominator
            (``npu_ops.md`` §3.3; transformers ``GptOssAttention``).
        num_heads: query heads per rank the impl was built with.
        where: description of the layer for the error message.

    Raises:
        TypeError: ``sinks`` is not a tensor or not floating point.
        ValueError: ``sinks`` is not 1-D of length ``num_heads``.
    """
    import torch

    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{where}: sinks must be a torch.Tensor of shape [{num_heads}], got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"{where}: sinks must be floating point (bfloat16 as in the GPT-OSS checkpoints), "
                        f"got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(f"{where}: sinks must have shape [{num_heads}] (query heads per tensor-parallel rank), "
                         f"got {list(sinks.shape)}")
    return sinks


def _keep_sinks(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendAttentionBackendImpl.__init__``: store ``sinks`` as ``self.sinks``."""
    sinks = kwargs.pop("sinks", None)
    result = wrapped(*args, **kwargs)
    if sinks is not None:
        where = (f"AscendAttentionBackendImpl(num_heads={instance.num_heads}, num_kv_heads={instance.num_kv_heads}, "
                 f"sliding_window={getattr(instance, 'sliding_window', None)})")
        sinks = validate_sinks(sinks, instance.num_heads, where)
    instance.sinks = sinks
    return result


PATCHES = [
    PatchSpec(
        name="attention.keep_sinks",
        target_key="attention_impl_init",
        wrapper=_keep_sinks,
        params=("num_heads", "head_size", "scale", "num_kv_heads", "sliding_window", "**"),
        absent_params=("sinks",),
        summary="AscendAttentionBackendImpl keeps the GPT-OSS attention sinks as self.sinks",
    ),
]
