"""Structured outputs: a constrained GPT-OSS request batched with plain ones no longer kills the engine (0.13.x).

Why
    vllm-ascend applies xgrammar's token bitmask to the logits on the host (``logits.to("cpu")`` in
    ``NPUModelRunner``), so xgrammar's CPU kernel runs. From 0.13.0rc1 the runner calls vLLM's ``apply_grammar_bitmask``
    (``vllm/v1/structured_output/utils.py``, vLLM 0.13.0), which hands ``xgr.apply_token_bitmask_inplace`` the
    constrained rows of a mixed batch as a *tensor* of indices. xgrammar before 0.1.30 passes that tensor to a C++
    kernel that takes a list (``xgrammar/kernels/apply_token_bitmask_inplace_cpu.py``, 0.1.27): ``TypeError:
    apply_token_bitmask_inplace_cpu(): incompatible function arguments``, "EngineCore encountered a fatal error", and
    HTTP 500 for every request after it (vllm-ascend #6820, #5524; mlc-ai/xgrammar#507). vLLM 0.13.0 pins
    ``xgrammar == 0.1.27``; vllm-ascend requires ``xgrammar >= 0.1.30`` only from 0.14.0rc1 (PR #6151). Agent
    frameworks force tool calls (``tool_choice: "required"`` or a named function), so this is the request shape GPT-OSS
    users send most. 0.11.x and 0.12.0rc1 apply the mask with their own function and a list: not affected.
How
    One ``wrapt`` wrapper on xgrammar's Python CPU entry point (``apply_token_bitmask_inplace_cpu``, which
    ``xgrammar.apply_token_bitmask_inplace`` imports at each call): a tensor of indices is handed on as
    ``indices.tolist()`` - exactly what xgrammar 0.1.30 does itself - and everything else passes through unchanged.
    Only in a process that built a GPT-OSS model (:data:`gptoss_patch._state.gpt_oss_built`, set by the guard): other
    models keep upstream's behaviour (README: other models are left alone; ``verify`` names their fix,
    ``pip install "xgrammar>=0.1.30"``). Registered on the rows whose ``structured_outputs`` capability is *patched*
    (the 0.13.x rows) and only when the installed files show the crash (:func:`gptoss_patch.pairing.structured_outputs`:
    vLLM passes a tensor, xgrammar < 0.1.30); the defect check refuses an xgrammar that already converts.
Removal
    When no 0.13.x row is left in the matrix (0.14.0rc1 and later require an xgrammar that takes the tensor).
Proof
    ``tests/cell/test_structured_outputs.py`` (0.13.0 cell, xgrammar 0.1.27): vLLM's real ``apply_grammar_bitmask``
    raises the upstream ``TypeError`` without the patch (and for a process that built no GPT-OSS model) and masks
    exactly the constrained rows with it; the api server answers a constrained request batched with plain ones
    (``tests/cell/api_cases.py``).
"""

from __future__ import annotations

from typing import Any

from gptoss_patch.registry import PatchSpec

__all__ = ["PATCHES", "TARGETS", "listed_indices"]

#: Where the patch hooks (xgrammar-side: the CPU kernel's Python entry point, the same in xgrammar 0.1.25 - 0.1.29).
TARGETS: dict[str, str] = {
    "xgrammar_cpu_bitmask": "xgrammar.kernels.apply_token_bitmask_inplace_cpu:apply_token_bitmask_inplace_cpu",
}


def listed_indices(indices: Any) -> Any:
    """The row indices as xgrammar < 0.1.30's C++ kernel takes them: a ``torch.Tensor`` (1-D, integer; vLLM >= 0.12
    builds it as int32) becomes ``indices.tolist()`` (a list of ints, same values and order); ``None`` or a list is
    returned unchanged. Semantics: xgrammar 0.1.30 ``apply_token_bitmask_inplace_cpu`` (mlc-ai/xgrammar#507)."""
    import torch

    if isinstance(indices, torch.Tensor):
        return indices.tolist()
    return indices


def _bitmask_cpu(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from gptoss_patch import _state

    if not _state.gpt_oss_built:  # other models: upstream's behaviour, unchanged
        return wrapped(*args, **kwargs)
    if len(args) >= 4:
        args = (*args[:3], listed_indices(args[3]), *args[4:])
    elif "indices" in kwargs:
        kwargs = {**kwargs, "indices": listed_indices(kwargs["indices"])}
    return wrapped(*args, **kwargs)


PATCHES: list[PatchSpec] = [
    PatchSpec(
        name="structured_outputs.bitmask_indices",
        target_key="xgrammar_cpu_bitmask",
        wrapper=_bitmask_cpu,
        params=("logits", "bitmask", "vocab_size", "indices"),
        # xgrammar >= 0.1.30 converts the tensor itself (and needs nothing from us)
        defect_absent=("tolist()",),
        summary="vLLM's tensor of bitmask row indices reaches xgrammar < 0.1.30's CPU kernel as the list it takes "
                "(a constrained request batched with plain ones killed the engine on 0.13.x)",
    ),
]
