"""activate() / deactivate() / status(): the decision, and registering the post-import hooks.

Called by the ``.pth`` start-up hook (first ``import vllm_ascend``), by the ``vllm.general_plugins``
entry point (every vLLM process), by ``verify`` and by tests. Idempotent and thread-safe: the
first call decides and registers; later calls only record their source. A forked child inherits
the state (and the already-wrapped objects); a spawned child starts again from the ``.pth``.
"""

from __future__ import annotations

import functools
import sys
import threading

from gptoss_patch import _state, config, environment, evidence, matrix
from gptoss_patch._state import status  # noqa: F401 - the public status(), re-exported
from gptoss_patch.registry import Registry, Status, static_check

_lock = _state.lock
#: Set once the deciding activate() has registered its post-import hooks (after releasing _lock); a later caller
#: waits for it, so no caller goes on to import vllm-ascend before the hooks are in place.
_hooks_registered = threading.Event()
#: Thread id of the activate() call that registers the hooks (it must not wait for itself).
_registering: int | None = None

#: Decision recorded when GPTOSS_PATCH_DISABLE=1: nothing is patched, the guard stays armed.
DISABLED = "disabled"


def _structural_check(row: matrix.Row, installed_vllm: str | None = None) -> list[str]:
    """Static (ast, no import) check of both sides of the pairing: every vllm-ascend target the row's layout needs
    and - unless the installed vLLM (``installed_vllm``, its metadata version) is the row's paired release - every
    vLLM place GPT-OSS relies on (:data:`gptoss_patch.matrix.VLLM_RELIED`); returns failures."""
    from packaging.version import InvalidVersion, Version

    from gptoss_patch.patches import layout_plan

    try:
        plan = layout_plan(row.layout)
    except KeyError as exc:
        return [str(exc.args[0])]
    failures = [failure for spec, target in plan for failure in static_check(spec, target)]
    try:
        paired = installed_vllm is not None and row.vllm is not None and \
            Version(Version(installed_vllm).public) == Version(row.vllm)
    except InvalidVersion:
        paired = False
    return failures if paired else failures + vllm_structural_check()


def vllm_structural_check() -> list[str]:
    """Static check of the installed vLLM against :data:`gptoss_patch.matrix.VLLM_RELIED`; returns failures."""
    from gptoss_patch.registry import PatchSpec

    failures = []
    for key, (locations, params) in matrix.VLLM_RELIED.items():
        spec = PatchSpec(f"vllm.{key}", key, wrapper=None, params=params)
        results = [static_check(spec, loc) for loc in locations]
        found = [r for r in results if not any(("not found" in f or "not defined" in f) for f in r)]
        if not found:
            failures.append(f"vLLM side: {key}: none of {', '.join(locations)} exists")
        else:
            failures.extend(f"vLLM side: {f}" for f in found[0])
    return failures


def _decide(force: bool | None) -> tuple[environment.Versions, matrix.Decision]:
    """The versions and the decision, computed *without* :data:`_lock` (it reads metadata and files only).

    Also imports every module the locked part of :func:`activate` and the post-import hooks need, so that
    nothing is imported while :data:`_lock` is held (see :func:`activate`).
    """
    import multiprocessing  # noqa: F401 - evidence._role, logged under the lock

    import wrapt  # noqa: F401

    from gptoss_patch.patches import all_specs, expert_parallel, guard, mxfp4  # noqa: F401

    all_specs()  # imports the capability modules layout_plan() reads
    versions = environment.installed_versions()
    try:
        disabled = config.flag(config.DISABLE)
        if force is None:
            force = config.flag(config.FORCE)
    except ValueError as exc:  # fail closed: a typo must not leave GPT-OSS unpatched *and* unguarded
        return versions, matrix.Decision(matrix.REFUSE, f"configuration error: {exc}; nothing is patched")
    if disabled:
        return versions, matrix.Decision(DISABLED, "GPTOSS_PATCH_DISABLE=1: no patch is applied (the GPT-OSS guard "
                                                   "stays armed)")
    if versions.duplicates:
        listing = "; ".join(f"{name}: {', '.join(paths)}" for name, paths in versions.duplicates.items())
        return versions, matrix.Decision(matrix.REFUSE, f"several installations of one distribution ({listing}); "
                                                        "which one runs is ambiguous: uninstall all but one")
    declared = _declared(versions)
    decision = matrix.decide(versions.vllm_ascend, versions.vllm, force=force, vllm_declared=declared,
                             structural_check=functools.partial(_structural_check, installed_vllm=versions.vllm_installed))
    row = decision.row
    if decision.verdict == matrix.STAND_DOWN or (
            decision.verdict == matrix.APPLY and matrix.native_sinks(row) and row.caps["moe"].state == matrix.NATIVE):
        # upstream's MoE code runs unpatched (stand-down, layout H): check the defect a mismatched vLLM brings (a
        # forced, declared or structurally mapped pairing, an edited install) in the installed files themselves
        problems = native_pairing_problems(declared)
        if problems:
            return versions, matrix.Decision(matrix.REFUSE, "; ".join(problems), decision.row)
    return versions, decision


def _declared(versions: environment.Versions) -> bool:
    """True when ``VLLM_VERSION`` names another release than the installed vLLM's (a source build)."""
    from packaging.version import InvalidVersion, Version

    if versions.vllm is None or versions.vllm_installed is None or versions.vllm == versions.vllm_installed:
        return False
    try:
        return Version(versions.vllm).public != Version(versions.vllm_installed).public
    except InvalidVersion:
        return True


def vllm_passes_enum() -> bool:
    """True when the installed vLLM's ``FusedMoE`` turns its activation into the ``MoEActivation`` Enum
    (``MoEActivation.from_str`` in ``vllm/model_executor/layers/fused_moe/layer.py``: vLLM >= 0.17); read, not
    imported."""
    from gptoss_patch.registry import module_source_path

    path = module_source_path("vllm.model_executor.layers.fused_moe.layer")
    if path is None:
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            return "MoEActivation.from_str(" in fh.read()
    except OSError:
        return False


def native_pairing_problems(declared: bool = False) -> list[str]:
    """What makes upstream's native GPT-OSS code wrong with the installed vLLM, read from the installed files.

    * vLLM passes the ``MoEActivation`` Enum while vllm-ascend's ``unquant_apply_mlp`` compares a string (the defect
      of ``moe.activation_name``, :data:`gptoss_patch.patches.moe.PATCHES`): every expert would run plain SwiGLU;
    * with a declared vLLM (``VLLM_VERSION``): any place GPT-OSS relies on (:func:`vllm_structural_check`).
    """
    from gptoss_patch.patches import all_specs

    spec = all_specs()["moe.activation_name"]
    target = matrix.LAYOUTS["G"][spec.target_key]
    problems = []
    if vllm_passes_enum() and not static_check(spec, target):
        problems.append(f"the installed vLLM passes the MoE activation as the MoEActivation Enum and {target} "
                        "compares it with a string: GPT-OSS experts would run plain SwiGLU (vllm-ascend #8463); "
                        "install the vLLM this vllm-ascend pairs with")
    if declared:
        problems += vllm_structural_check()
    return problems


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
            _state.versions, _state.decision = decided
            _registering = threading.get_ident()
            if _state.decision.forced:
                sys.stderr.write(f"gptoss-patch: WARNING: {_state.decision.reason}\n")
            if _state.decision.verdict == matrix.APPLY and _state.decision.row is not None:
                hooks += _register(_state.decision.row)
            if _state.decision.verdict in (matrix.APPLY, matrix.STAND_DOWN) and _state.decision.row is not None:
                hooks += _register_checkpoint(_state.decision.row)
            if _state.versions.vllm_ascend is not None:
                hooks += _arm_guard()  # also on stand-down: it refuses the row's refused capabilities at model build
            evidence.activation(source, _state.decision)
    if not first:
        if _registering != threading.get_ident():  # the deciding call may still be registering its hooks
            _hooks_registered.wait()
        return status(drift=False)
    import wrapt

    try:
        for registry, module in hooks:
            wrapt.register_post_import_hook(functools.partial(_hook, registry), module)
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

    * MXFP4 (:mod:`gptoss_patch.patches.mxfp4`, :data:`gptoss_patch.matrix.MXFP4_TARGETS`) when the row's
      ``checkpoint_mxfp4`` capability is *patched*;
    * the expert-parallel range (:mod:`gptoss_patch.patches.expert_parallel`) when its ``checkpoint_bf16`` is.
    """
    from gptoss_patch.patches import expert_parallel, mxfp4

    specs, targets = [], {}
    cap = row.caps.get("checkpoint_mxfp4")
    if cap is not None and cap.state == matrix.PATCHED:
        specs += mxfp4.PATCHES
        targets.update(matrix.MXFP4_TARGETS)
    cap = row.caps.get("checkpoint_bf16")
    if cap is not None and cap.state == matrix.PATCHED:
        specs += expert_parallel.PATCHES
        targets.update(expert_parallel.TARGETS)
    if not specs:
        return []
    registry = Registry(specs, targets)
    _state.checkpoint = registry
    return [(registry, module) for module in registry.target_modules()]


def checkpoint_patch_states() -> dict[str, str]:
    """The vLLM-side checkpoint patches of this process (MXFP4, expert-parallel range): ``{name: "state: reason"}``
    (empty when the row has none)."""
    with _lock:
        reg = _state.checkpoint
    return {name: f"{st.state}: {st.reason}" for name, st in reg.states.items()} if reg is not None else {}


def _register(row: matrix.Row) -> list[tuple[Registry, str]]:
    """Create the registry of ``row``'s layout; returns the post-import hooks to register (registry, module)."""
    from gptoss_patch.patches import layout_plan

    registry = Registry([spec for spec, _ in layout_plan(row.layout)], matrix.LAYOUTS[row.layout or ""])
    _state.registry = registry
    return [(registry, module) for module in registry.target_modules()]


def _hook(registry: Registry, module) -> None:
    # A hook must never break the user's import; the registry records failures in the status.
    try:
        registry.on_import(module)
    except Exception as exc:  # noqa: BLE001
        for st in registry.states.values():
            if st.state == "pending" and st.target.startswith(module.__name__ + ":"):
                st.state, st.reason = "failed", f"hook raised {type(exc).__name__}: {exc}"


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
        if _state.registry is not None:
            _state.registry.remove_all()
    return status()
