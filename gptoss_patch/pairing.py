"""Judging the installed pair: which matrix row the installed vllm-ascend and vLLM are, and whether their code is what
the row's patches and upstream's native GPT-OSS code rely on (public; :mod:`gptoss_patch._activation` registers what
the judgement says, ``tests/unit/test_matrix_wheels.py`` and ``tests/cell/test_pairing.py`` run it on released files).

* :func:`judge` - the versions and the decision (the configuration, duplicate installs, the matrix, the checks);
* :func:`structural_check` - static (``ast``, no import) check of both sides of the pairing for a row;
* :func:`vllm_structural_check` - the installed vLLM against :data:`gptoss_patch.matrix.VLLM_RELIED`;
* :func:`native_pairing_problems` - what makes upstream's native code wrong with the installed vLLM, by the row data
  :data:`gptoss_patch.matrix.NATIVE_PAIRING_RULES` (today: vLLM's ``MoEActivation`` Enum against vllm-ascend's string
  compare, vllm-ascend #8463);
* :func:`declared_vllm` - whether ``VLLM_VERSION`` names another release than the installed vLLM;
* :func:`structured_outputs` - whether vLLM's structured outputs work with the installed xgrammar on vllm-ascend.
"""

from __future__ import annotations

import functools

from gptoss_patch import config, environment, matrix
from gptoss_patch.registry import static_check


def judge(force: bool | None = None) -> tuple[environment.Versions, matrix.Decision]:
    """The installed versions and the matrix's decision for them (never raises; reads metadata and files only).

    Order: a malformed ``GPTOSS_PATCH_DISABLE`` / ``GPTOSS_PATCH_FORCE`` refuses (fail closed); ``DISABLE=1`` gives
    the *disabled* decision; several installations of one distribution refuse; otherwise
    :func:`gptoss_patch.matrix.decide` with the structural check of both sides (:func:`structural_check`), and a
    native row whose upstream MoE code runs unpatched is refused when the installed files show the row's pairing
    defects (:func:`native_pairing_problems`). ``force``: apply even when the matrix refuses; default reads
    ``GPTOSS_PATCH_FORCE``.
    """
    versions = environment.installed_versions()
    try:
        disabled = config.flag(config.DISABLE)
        if force is None:
            force = config.flag(config.FORCE)
    except ValueError as exc:  # fail closed: a typo must not leave GPT-OSS unpatched *and* unguarded
        return versions, matrix.Decision(matrix.REFUSE, f"configuration error: {exc}; nothing is patched")
    if disabled:
        return versions, matrix.Decision(matrix.DISABLED, "GPTOSS_PATCH_DISABLE=1: no patch is applied (the GPT-OSS guard "
                                                   "stays armed)")
    if versions.duplicates:
        listing = "; ".join(f"{name}: {', '.join(paths)}" for name, paths in versions.duplicates.items())
        return versions, matrix.Decision(matrix.REFUSE, f"several installations of one distribution ({listing}); "
                                                        "which one runs is ambiguous: uninstall all but one")
    declared = declared_vllm(versions)
    decision = matrix.decide(versions.vllm_ascend, versions.vllm, force=force, vllm_declared=declared,
                             structural_check=functools.partial(structural_check, installed_vllm=versions.vllm_installed))
    row = decision.row
    if decision.verdict == matrix.STAND_DOWN or (
            decision.verdict == matrix.APPLY and matrix.native_sinks(row) and row.caps["moe"].state == matrix.NATIVE):
        # upstream's MoE code runs unpatched (stand-down, layouts H and I): check the defect a mismatched vLLM brings (a
        # forced, declared or structurally mapped pairing, an edited install) in the installed files themselves
        problems = native_pairing_problems(declared)
        if problems:
            return versions, matrix.Decision(matrix.REFUSE, "; ".join(problems), decision.row)
    return versions, decision


def structural_check(row: matrix.Row, installed_vllm: str | None = None) -> list[str]:
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


def declared_vllm(versions: environment.Versions) -> bool:
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
    from gptoss_patch.fingerprint import module_source_path

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

    * each rule of :data:`gptoss_patch.matrix.NATIVE_PAIRING_RULES` whose trigger holds for the installed vLLM and
      whose defect the installed vllm-ascend still has (the rule's patch passes its structural check on the installed
      target), e.g. vLLM passes the ``MoEActivation`` Enum while ``unquant_apply_mlp`` compares a string: every expert
      would run plain SwiGLU;
    * with a declared vLLM (``VLLM_VERSION``): any place GPT-OSS relies on (:func:`vllm_structural_check`).
    """
    from gptoss_patch.patches import all_specs

    problems = []
    for rule in matrix.NATIVE_PAIRING_RULES:
        spec = all_specs()[rule.patch]
        target = matrix.LAYOUTS[rule.layout][spec.target_key]
        if _TRIGGERS[rule.trigger]() and not static_check(spec, target):
            problems.append(f"{rule.problem.format(target=target)}; install the vLLM this vllm-ascend pairs with")
    if declared:
        problems += vllm_structural_check()
    return problems




#: The first xgrammar whose CPU kernel wrapper turns tensor indices into the list its C++ kernel takes
#: (``xgrammar/kernels/apply_token_bitmask_inplace_cpu.py``: 0.1.27 and 0.1.29 pass the tensor on; mlc-ai/xgrammar#507).
XGRAMMAR_TENSOR_INDICES = "0.1.30"


def structured_outputs() -> dict:
    """Whether a structured-output request (``response_format: json_schema``, ``tool_choice: "required"`` or a named
    function, ``structured_outputs``) can be served by the installed vLLM + xgrammar on vllm-ascend; files read, nothing
    imported.

    vllm-ascend applies xgrammar's token bitmask to the logits on the host (``logits.to("cpu")`` in
    ``NPUModelRunner``), so xgrammar's CPU kernel runs. When a batch mixes constrained and plain requests, the
    constrained rows' indices are passed along: vllm-ascend 0.11.0 and 0.12.0rc1 apply the mask with their own
    ``apply_grammar_bitmask`` and a list; from 0.13.0 the runner calls vLLM's (``vllm/v1/structured_output/utils.py``),
    which passes a tensor (vLLM >= 0.12), and xgrammar < 0.1.30 hands that to a C++ kernel that takes a list:
    ``TypeError: apply_token_bitmask_inplace_cpu(): incompatible function arguments`` and the engine dies
    (vllm-ascend #6820, #5524: the 0.13.x rows, whose vLLM pins xgrammar 0.1.27; vllm-ascend requires >= 0.1.30 from
    0.14.0rc1, PR #6151). Shown in tests/cell/test_api.py.

    Returns:
        ``{"xgrammar": installed version or None, "indices": "tensor" | "list" | None, "problem": str | None}``;
        ``problem`` names what fails and the fix.
    """
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    from gptoss_patch.fingerprint import module_source_path

    try:
        xgr = metadata.version("xgrammar")
    except metadata.PackageNotFoundError:
        xgr = None
    def read(module: str) -> str:
        path = module_source_path(module)
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, TypeError):  # not installed (path None) or unreadable
            return ""

    runner, utils = read("vllm_ascend.worker.model_runner_v1"), read("vllm.v1.structured_output.utils")
    indices = None
    if "from vllm.v1.structured_output.utils import apply_grammar_bitmask" in runner:
        indices = "tensor" if "indices=index_tensor" in utils else "list"
    elif "def apply_grammar_bitmask" in runner:  # vllm-ascend's own (0.11.0, 0.12.0rc1): a list of indices
        indices = "tensor" if "indices=index_tensor" in runner else "list"
    path = utils or None
    problem = None
    if xgr is None and path is not None:
        problem = ("xgrammar is not installed: every json_schema / tool_choice 'required' / named-function request "
                   "fails (HTTP 500); install the xgrammar your vLLM requires (pip install vllm's pin)")
    elif xgr is not None and indices == "tensor":
        try:
            old = Version(xgr) < Version(XGRAMMAR_TENSOR_INDICES)
        except InvalidVersion:
            old = False
        if old:
            problem = (f"xgrammar {xgr} with this vLLM: a batch that mixes a structured-output request with plain ones "
                       "kills the engine (TypeError: apply_token_bitmask_inplace_cpu(): incompatible function "
                       f"arguments); pip install \"xgrammar>={XGRAMMAR_TENSOR_INDICES}\"")
    return {"xgrammar": xgr, "indices": indices, "problem": problem}


#: What a :data:`gptoss_patch.matrix.NATIVE_PAIRING_RULES` trigger name reads in the installed vLLM.
_TRIGGERS = {"vllm_passes_enum": vllm_passes_enum}
