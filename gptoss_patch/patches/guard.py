"""Guard: building a GPT-OSS model on a stack we did not fully patch fails loudly instead of serving garbage.

Why
    Unpatched vllm-ascend 0.11-0.14 starts a GPT-OSS server that emits garbage (sinks dropped,
    swigluoai and expert biases ignored). If our decision is not *apply* (a refused release, a forced
    or disabled activation, a structural-check failure) or any GPT-OSS patch did not apply, the worst
    outcome is a server that runs. The guard turns that into an error at model construction.
How
    A wrapt post-import hook on ``vllm.model_executor.models.gpt_oss`` wraps
    ``GptOssForCausalLM.__init__``. After the original constructor ran (by then vLLM has imported
    every vllm-ascend module our patches target: the attention backend and the MoE layers are built
    inside it), it checks :func:`gptoss_patch.status` and raises :class:`GptOssNotPatchedError`
    listing every patch that is not applied, and what to do. Other models never reach it. The guard
    is armed on every decision except *stand-down* (native support), including
    ``GPTOSS_PATCH_DISABLE=1``: disabling the patches does not make garbage acceptable
    (``GPTOSS_PATCH_ALLOW_UNPATCHED=1`` lets a GPT-OSS model load anyway, for experiments).
Upstream releases
    vLLM 0.11.0 ... 0.14.x ``vllm/model_executor/models/gpt_oss.py`` (class name stable).
Remove when
    gptoss-patch itself is removed.
"""

from __future__ import annotations

import os
from typing import Any


class GptOssNotPatchedError(RuntimeError):
    """A GPT-OSS model was built on vllm-ascend without every GPT-OSS patch applied."""


def check(status: Any, include_pending: bool = True) -> None:
    """Raise :class:`GptOssNotPatchedError` unless ``status`` says GPT-OSS is safe to run.

    Args:
        status: a :class:`gptoss_patch.registry.Status`.
        include_pending: list patches still waiting for their module among those not applied (False when the build
            stopped early because of a failed patch: the modules of the pending ones were simply not reached).

    Raises:
        GptOssNotPatchedError: decision not *apply*/*stand-down*, or a patch not applied; the message lists
            the patches and their reasons and says how to fix it.
    """
    if status.decision == "stand-down":
        return
    if os.environ.get("GPTOSS_PATCH_ALLOW_UNPATCHED", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    missing = [p for p in status.patches if p.state != "applied"]
    if status.decision == "apply" and status.patches and not missing:
        return
    if not include_pending and any(p.state != "pending" for p in missing):
        missing = [p for p in missing if p.state != "pending"]
    lines = [f"refusing to build a GPT-OSS model on vllm-ascend {status.versions.get('vllm_ascend')}: "
             f"it would produce wrong outputs.",
             f"  decision: {status.decision} - {status.reason}"]
    for p in missing:
        lines.append(f"  not applied: {p.name} ({p.target}): {p.state} - {p.reason}")
    if status.decision != "apply" and not status.patches:
        lines.append("  not applied: every GPT-OSS patch (attention sinks and sliding window, swigluoai MoE with "
                     "biases, FRACTAL_NZ padding, ACL graph update)")
    lines.append("  what to do: run `python -m gptoss_patch.verify`; use a supported vllm-ascend release "
                 "(see `python -m gptoss_patch.verify --matrix`) or vllm-ascend >= 0.15.0rc1; unset "
                 "GPTOSS_PATCH_DISABLE if set. GPTOSS_PATCH_ALLOW_UNPATCHED=1 loads anyway (wrong outputs).")
    raise GptOssNotPatchedError("\n".join(lines))


def _guard_init(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``GptOssForCausalLM.__init__``: build, then :func:`check` the status.

    The patches whose modules are imported while the model is built are only applied then, so the check follows the
    build. If the build itself fails on an unpatched stack (vLLM >= 0.12 passes YaRN ``truncate=``, which vllm-ascend
    < 0.15 rejects with ``TypeError``), the guard's error is raised instead, chained to the original one.
    """
    import gptoss_patch

    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        try:
            check(gptoss_patch.status(), include_pending=False)
        except GptOssNotPatchedError as err:
            raise err from exc
        raise
    check(gptoss_patch.status())
    return result


#: The guard target (same in every supported vLLM release).
TARGET_MODULE = "vllm.model_executor.models.gpt_oss"
TARGET = f"{TARGET_MODULE}:GptOssForCausalLM.__init__"
