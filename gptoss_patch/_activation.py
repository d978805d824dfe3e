"""activate() / deactivate() / status(): the decision, and registering the post-import hooks.

Called by the ``.pth`` start-up hook (first ``import vllm_ascend``), by the ``vllm.general_plugins``
entry point (every vLLM process), by ``verify`` and by tests. Idempotent and thread-safe: the
first call decides and registers; later calls only record their source. A forked child inherits
the state (and the already-wrapped objects); a spawned child starts again from the ``.pth``.
"""

from __future__ import annotations

import sys
import threading

from gptoss_patch import _state, environment, evidence, matrix, pairing
from gptoss_patch._state import status  # noqa: F401 - the public status(), re-exported
from gptoss_patch.registry import Registry, Status

_lock = _state.lock
#: Set once the deciding activate() has registered its post-import hooks (after releasing _lock); a later caller
#: waits for it, so no caller goes on to import vllm-ascend before the hooks are in place.
_hooks_registered = threading.Event()
#: Thread id of the activate() call that registers the hooks (it must not wait for itself).
_registering: int | None = None

#: Decision recorded when GPTOSS_PATCH_DISABLE=1 (:data:`gptoss_patch.matrix.DISABLED`).
DISABLED = matrix.DISABLED


def _decide(force: bool | None) -> tuple[environment.Versions, matrix.Decision, bool]:
    """:func:`gptoss_patch.pairing.judge`, computed *without* :data:`_lock`, after importing every module the locked
    part of :func:`activate` and the post-import hooks need, so that nothing is imported while :data:`_lock` is held
    (see :func:`activate`). The third value: whether the structured-output patch is needed (:func:`_needs_bitmask_fix`,
    files read only on the rows that may need it)."""
    import multiprocessing  # noqa: F401 - evidence._role, logged under the lock

    import wrapt  # noqa: F401

    from gptoss_patch.patches import all_specs, checkpoint_bf16, checkpoint_mxfp4, guard, structured_outputs  # noqa: F401

    all_specs()  # imports the capability modules layout_plan() reads
    versions, decision = pairing.judge(force)
    return versions, decision, _needs_bitmask_fix(decision)


def _needs_bitmask_fix(decision: matrix.Decision) -> bool:
    """True when the row's ``structured_outputs`` capability is *patched* (the 0.13.x rows) and the installed files
    show the crash the patch avoids: vLLM hands xgrammar a tensor of indices and xgrammar is older than
    :data:`gptoss_patch.pairing.XGRAMMAR_TENSOR_INDICES` (:func:`gptoss_patch.pairing.structured_outputs`)."""
    row = decision.row
    if decision.verdict not in (matrix.APPLY, matrix.STAND_DOWN) or row is None:
        return False
    cap = row.caps.get("structured_outputs")
    if cap is None or cap.state != matrix.PATCHED:
        return False
    found = pairing.structured_outputs()
    return found["indices"] == "tensor" and found["problem"] is not None and found["xgrammar"] is not None


def activate(source: str = "api", force: bool | None = None) -> Status:
    """Decide from the installed versions and, on *apply*, register the post-import hooks.

    Args:
        source: who is calling (recorded in :func:`status`).
        force: apply even when the matrix refuses; default reads ``GPTOSS_PATCH_FORCE``.

    Returns:
        The :class:`gptoss_patch.registry.Status` after activation, without drift verdicts (activation runs in every
        worker; :func:`status` computes them when asked).

    Never raises for bad configuration: a malformed ``GPTOSS_PATCH_DISABLE``/``GPTOSS_PATCH_FORCE`` gives a
    *refuse* decision naming the variable, with the GPT-OSS guard armed.

    Lock order: nothing is imported while :data:`_lock` is held. The decision (and every import it and the
    hooks need) is made first, without the lock; only recording it takes the lock; the post-import hooks are
    registered after it is released (wrapt runs a hook at once when its module is already imported). A thread
    that holds an import lock and waits for :data:`_lock` therefore cannot deadlock with the holder of
    :data:`_lock` (issue 17).
    """
    global _registering
    decided = _decide(force) if _state.decision is None else None
    hooks: list[tuple[Registry, str]] = []
    with _lock:
        _state.sources.append(source)
        first = _state.decision is None
        if first:
            if decided is None:  # defensive: the state was set when we looked and is unset now
                decided = _decide(force)
            _state.versions, _state.decision, bitmask_fix = decided
            _registering = threading.get_ident()
            if _state.decision.forced:
                sys.stderr.write(f"gptoss-patch: WARNING: {_state.decision.reason}\n")
            if _state.decision.verdict == matrix.APPLY and _state.decision.row is not None:
                hooks += _register(_state.decision.row)
            if _state.decision.verdict in (matrix.APPLY, matrix.STAND_DOWN) and _state.decision.row is not None:
                hooks += _register_checkpoint(_state.decision.row)
            if bitmask_fix:
                hooks += _register_structured_outputs()
            if _state.versions.vllm_ascend is not None:
                hooks += _arm_guard()  # also on stand-down: it refuses the row's refused capabilities at model build
            evidence.activation(source, _state.decision,
                                [name for reg in (_state.registry, _state.checkpoint, _state.structured, _state.guard)
                                 if reg is not None for name, st in reg.states.items() if st.target != "-"])
    if not first:
        if _registering != threading.get_ident():  # the deciding call may still be registering its hooks
            _hooks_registered.wait()
        return status(drift=False)
    import wrapt

    from gptoss_patch.registry import registering

    try:
        with registering():  # a module already imported but still executing is deferred, not failed (issue 32)
            for registry, module in hooks:
                wrapt.register_post_import_hook(registry.hook, module)
    finally:
        _hooks_registered.set()
    return status(drift=False)


def _arm_guard() -> list[tuple[Registry, str]]:
    """Create the GPT-OSS model guard's registry (:data:`gptoss_patch.patches.guard.PATCHES`); returns its hook to
    register (registry, module)."""
    from gptoss_patch.patches import guard

    _state.guard = Registry(guard.PATCHES, {"guard": guard.TARGET})
    return [(_state.guard, guard.TARGET_MODULE)]


def _register_checkpoint(row: matrix.Row) -> list[tuple[Registry, str]]:
    """The vLLM-side checkpoint patches of ``row``, on apply and stand-down rows alike; returns their hooks:

    * MXFP4 (:mod:`gptoss_patch.patches.checkpoint_mxfp4`, :data:`gptoss_patch.matrix.MXFP4_TARGETS`) when the row's
      ``checkpoint_mxfp4`` capability is *patched*;
    * the expert-parallel range (:mod:`gptoss_patch.patches.checkpoint_bf16`) when its ``checkpoint_bf16`` is.
    """
    from gptoss_patch.patches import checkpoint_bf16, checkpoint_mxfp4

    specs, targets = [], {}
    cap = row.caps.get("checkpoint_mxfp4")
    if cap is not None and cap.state == matrix.PATCHED:
        specs += checkpoint_mxfp4.PATCHES
        targets.update(matrix.MXFP4_TARGETS)
    cap = row.caps.get("checkpoint_bf16")
    if cap is not None and cap.state == matrix.PATCHED:
        specs += checkpoint_bf16.PATCHES
        targets.update(checkpoint_bf16.TARGETS)
    if not specs:
        return []
    registry = Registry(specs, targets)
    _state.checkpoint = registry
    return [(registry, module) for module in registry.target_modules()]


def _register_structured_outputs() -> list[tuple[Registry, str]]:
    """The xgrammar-side patch (:mod:`gptoss_patch.patches.structured_outputs`); returns its hook."""
    from gptoss_patch.patches import structured_outputs

    registry = Registry(structured_outputs.PATCHES, structured_outputs.TARGETS)
    _state.structured = registry
    return [(registry, module) for module in registry.target_modules()]


def _register(row: matrix.Row) -> list[tuple[Registry, str]]:
    """Create the registry of ``row``'s layout; returns the post-import hooks to register (registry, module)."""
    from gptoss_patch.patches import layout_plan

    registry = Registry([spec for spec, _ in layout_plan(row.layout)], matrix.LAYOUTS[row.layout or ""])
    _state.registry = registry
    return [(registry, module) for module in registry.target_modules()]


def deactivate() -> Status:
    """Remove every applied patch (originals restored, by-value names rebound back). Returns the status.

    One-way for the process: the decision stays and a later :func:`activate` does not re-apply (it only records its
    source), because the post-import hooks cannot be unregistered from wrapt and the modules are already imported.
    The GPT-OSS guard stays armed, so building a GPT-OSS model after this raises ``GptOssNotPatchedError`` instead of
    serving unpatched upstream code.
    """
    with _lock:
        if _state.checkpoint is not None:
            _state.checkpoint.remove_all()
        if _state.structured is not None:
            _state.structured.remove_all()
        if _state.registry is not None:
            _state.registry.remove_all()
    return status()
