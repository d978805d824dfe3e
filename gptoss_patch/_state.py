"""What gptoss-patch decided and did in this process, and :func:`status` - the layer every other module may ask.

:mod:`gptoss_patch._activation` writes this state (under :data:`lock`); the patches read it through :func:`status`
(e.g. the active layout, :mod:`gptoss_patch.patches.attention_graph.capture`). It imports neither the patches nor
:mod:`gptoss_patch._activation`, so asking it never closes an import circle.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

from gptoss_patch import environment, matrix
from gptoss_patch.registry import APPLIED, PatchState, Registry, Status

#: Taken to record or read the state. Nothing is imported while it is held (see gptoss_patch._activation.activate).
lock = threading.RLock()
#: Who called activate(), in order.
sources: list[str] = []
#: The decision (None before activation), the versions it rests on, the registry of the row's patches and the
#: guard's registry.
decision: matrix.Decision | None = None
versions: environment.Versions | None = None
registry: Registry | None = None
guard: Registry | None = None
#: The MXFP4 checkpoint patches (gptoss_patch.patches.checkpoint_mxfp4), when the row has them.
checkpoint: Registry | None = None
#: The structured-output patch (gptoss_patch.patches.structured_outputs), when the installed pairing needs it.
structured: Registry | None = None
#: Set by the guard once a GPT-OSS model was built in this process: the structured-output patch acts only then.
gpt_oss_built: bool = False
#: True while the guard builds a GPT-OSS model (``GptOssForCausalLM.__init__``, which builds the attention impls), or
#: while the self-test builds GPT-OSS layers (:func:`building_gpt_oss`): patches that act on an impl as it is
#: constructed (:mod:`gptoss_patch.patches.attention` ``band_128_keys``) act only then - other models' layers keep
#: upstream's values.
gpt_oss_building: bool = False


@contextlib.contextmanager
def building_gpt_oss() -> Iterator[None]:
    """Mark the code inside as building GPT-OSS layers (:data:`gpt_oss_building`); restores the previous value."""
    global gpt_oss_building
    before = gpt_oss_building
    gpt_oss_building = True
    try:
        yield
    finally:
        gpt_oss_building = before


def status(drift: bool = True) -> Status:
    """Current :class:`gptoss_patch.registry.Status` of this process (no side effects).

    Before activation it reads the installed versions, without :data:`lock`. With ``drift`` (the default, what
    ``gptoss_patch.status()`` and ``verify`` ask), applied patches carry their drift verdict
    (:func:`gptoss_patch.drift.describe`: the installed target's fingerprint against the releases, read and hashed
    once per process); the callers on a worker's path (``activate()``, the guard, the ACL-graph capture) pass
    ``drift=False`` and leave ``fingerprint`` / ``drift`` None.
    """
    if decision is None:
        found = environment.installed_versions()
        with lock:
            if decision is None:
                return Status(False, [], None, "not activated in this process (vllm_ascend has not been imported)",
                              None, False, found.as_dict(), [])
    with lock:
        patches = [PatchState(**vars(s)) for s in registry.states.values()] if registry else []
        dec, ver, srcs = decision, versions, list(sources)
        guard_state = guard.states.get("guard.gpt_oss_model") if guard else None
        checkpoint_states = ({name: f"{st.state}: {st.reason}" for name, st in checkpoint.states.items()}
                             if checkpoint else {})
        structured_states = ({name: f"{st.state}: {st.reason}" for name, st in structured.states.items()}
                             if structured else {})
    if drift and any(p.state == APPLIED for p in patches):
        from gptoss_patch import drift as drifts

        for p in patches:
            if p.state == APPLIED:
                p.fingerprint, p.drift = drifts.describe(p.target)
    details = {"guard": f"{guard_state.state}: {guard_state.reason}" if guard_state else "not armed"}
    # the vLLM-side checkpoint registry holds two capabilities' patches, each named after its capability:
    # checkpoint_mxfp4.* and checkpoint_bf16.* (the expert-parallel range of vLLM 0.11.0)
    for cap in ("checkpoint_mxfp4", "checkpoint_bf16"):
        states = {name: st for name, st in checkpoint_states.items() if name.startswith(cap + ".")}
        if states:
            details[cap] = states
    if structured_states:
        details["structured_outputs"] = structured_states
    kernels = sys.modules.get("gptoss_patch.kernels.attention")
    if kernels is not None and kernels.path_description():
        details["attention_path"] = kernels.path_description()
    return Status(
        activated=True,
        sources=srcs,
        decision=dec.verdict,
        reason=dec.reason,
        row=dec.row.vllm_ascend if dec.row else None,
        forced=dec.forced,
        versions=ver.as_dict() if ver else {},
        patches=patches,
        gaps=list(dec.gaps),
        layout=dec.row.layout if dec.row and dec.verdict == matrix.APPLY else None,
        capabilities={name: {"state": cap.state, "note": cap.note}
                      for name, cap in (dec.row.caps.items() if dec.row else ())},
        details=details,
    )
