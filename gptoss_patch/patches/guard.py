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
    is armed on every decision, including *stand-down* and ``GPTOSS_PATCH_DISABLE=1``: disabling the
    patches does not make garbage acceptable (``GPTOSS_PATCH_ALLOW_UNPATCHED=1`` lets a GPT-OSS model load
    anyway, for experiments). Checks, in order:

    1. before the model is built (nothing loaded yet): the row's *refused* capabilities the configuration
       would use (:func:`refused_in_use`): FULL_DECODE_ONLY graphs where the graph path drops the sinks,
       ``pa_shape_list`` under full decode graphs, a quantized checkpoint, a BF16 checkpoint where loading is
       broken, an Atlas 310P card; then checkpoint tensors of the wrong shape (:func:`check_checkpoint`,
       safetensors headers only);
    2. after the build: every patch of the row applied (:func:`check`);
    3. after the build, *what runs* (:func:`unpatched_in_use`): for every object of the model whose class
       derives from a patched target class (the attention impl of each layer, each MoE quant method), the
       method that will run resolves to our wrapper - a subclass with its own override (vllm-ascend 0.14's
       310P attention ``AscendAttentionBackendImpl310.forward_impl``, a third-party backend) is caught here;
       on rows that refuse the 310P, its classes (:func:`p310_in_use`) too.
Upstream releases
    vLLM 0.11.0 ... 0.30.0 ``vllm/model_executor/models/gpt_oss.py`` (class name and the keyword-only
    ``vllm_config`` stable).
Remove when
    gptoss-patch itself is removed.
"""

from __future__ import annotations

import os
from typing import Any

from gptoss_patch.registry import PatchSpec


class GptOssNotPatchedError(RuntimeError):
    """A GPT-OSS model was built on vllm-ascend without every GPT-OSS patch applied."""


class GptOssCheckpointError(ValueError):
    """A GPT-OSS checkpoint tensor has a shape its ``config.json`` does not imply (found before any weight loads)."""


def check_checkpoint(vllm_config: Any) -> None:
    """Stop a GPT-OSS build whose local checkpoint holds a tensor of the wrong shape, naming it.

    Reads only the safetensors headers (:func:`gptoss_patch.checkpoints.mismatched_shapes`): without this, vLLM fails
    deep in the loader (``output with shape [8] doesn't match the broadcast shape [8, 8]`` for sinks saved as
    ``[8, 1]``). A model that is not a local directory (nothing to read before vLLM downloads it) is not checked.

    Raises:
        GptOssCheckpointError: one line per tensor: name, shape, expected shape.
    """
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if not isinstance(model, str) or not os.path.isfile(os.path.join(model, "config.json")):
        return
    from gptoss_patch.checkpoints import mismatched_shapes

    try:
        wrong = mismatched_shapes(model)
    except (ValueError, ImportError):  # an unusual config: vLLM's own loader reports it in its words
        return
    if wrong:
        lines = [f"  {name}: shape {list(shape)}, expected {list(expected)}" for name, shape, expected in wrong]
        raise GptOssCheckpointError("\n".join([f"the GPT-OSS checkpoint {model} has tensors of the wrong shape "
                                               "(read from the safetensors headers before loading):", *lines,
                                               "  what to do: re-export the checkpoint; `python -m gptoss_patch."
                                               "verify --model DIR` checks it"]))


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
    if _allowed_unpatched():
        return
    if status.decision == "stand-down":
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


def _allowed_unpatched() -> bool:
    """``GPTOSS_PATCH_ALLOW_UNPATCHED`` is on; a malformed value is not (fail closed)."""
    from gptoss_patch import config

    try:
        return config.flag(config.ALLOW_UNPATCHED)
    except ValueError:
        return False


def _is_310p() -> bool:
    """vllm-ascend's own answer (``vllm_ascend.utils.is_310p``, or ``get_ascend_device_type() is _310P`` on 0.12.0rc1
    and 0.13.x, which have no ``is_310p``; from 0.29.0rc1 ``vllm_ascend.device.device_config``:
    the SoC of the wheel build on 0.11, the wheel's device type checked against ``torch_npu``'s SoC from 0.12 on);
    False where vllm-ascend has no such function. :func:`p310_in_use` also looks at the classes that run."""
    for module in ("vllm_ascend.utils", "vllm_ascend.device.device_config"):  # the latter from 0.29.0rc1 on
        try:
            mod = __import__(module, fromlist=["is_310p"])
        except ImportError:
            continue
        if hasattr(mod, "is_310p"):
            return bool(mod.is_310p())
        if hasattr(mod, "get_ascend_device_type"):  # 0.12.0rc1 / 0.13.x: no is_310p, the device type only
            return getattr(mod.get_ascend_device_type(), "name", None) == "_310P"
    return False


def _full_decode_graphs(vllm_config: Any) -> str | None:
    """The cudagraph mode's name when decode batches run as FULL ACL graphs (FULL_DECODE_ONLY, FULL,
    FULL_AND_PIECEWISE: ``CUDAGraphMode.decode_mode() == FULL``, vLLM ``vllm/config/compilation.py``), else None."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return None
    if isinstance(mode, str):  # a config not yet resolved to vLLM's CUDAGraphMode
        return mode if mode.upper() in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE") else None
    decode = mode.decode_mode() if hasattr(mode, "decode_mode") else mode
    return mode.name if getattr(decode, "name", None) == "FULL" else None


def _context_parallel(vllm_config: Any) -> str | None:
    """``"prefill_context_parallel_size N, decode_context_parallel_size M"`` (the sizes above 1) when the
    configuration runs context parallelism - vllm-ascend's ``enable_cp()`` then hands the attention layers
    ``AscendAttentionCPImpl`` (vllm_ascend 0.12.0rc1+ ``attention/attention_v1.py`` ``get_impl_cls``) - else ``None``.
    vLLM's ``ParallelConfig`` fields; a vLLM without one counts it as 1."""
    parallel = getattr(vllm_config, "parallel_config", None)
    sizes = [(name, getattr(parallel, name, 1) or 1) for name in ("prefill_context_parallel_size",
                                                                  "decode_context_parallel_size")]
    used = [f"{name} {size}" for name, size in sizes if isinstance(size, int) and size > 1]
    return ", ".join(used) or None


def _pa_shapes(vllm_config: Any) -> list:
    """vllm-ascend's ``additional_config.pa_shape_list`` (decode sizes that take ``_npu_paged_attention`` under
    FULL_DECODE_ONLY, ``vllm_ascend/attention/utils.py`` ``using_paged_attention``); empty when unset."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return list(extra.get("pa_shape_list") or []) if isinstance(extra, dict) else []


def refused_in_use(capabilities: dict, vllm_config: Any) -> list[str]:
    """The row's *refused* GPT-OSS capabilities that this configuration would use, one line each.

    Args:
        capabilities: ``status().capabilities`` (capability -> ``{"state", "note"}``).
        vllm_config: vLLM's ``VllmConfig`` the model is being built with (``None``: only device checks run).

    Returns:
        ``"<capability>: <why it is refused and what avoids it> (in use: <the setting>)"`` per refused capability in
        use; empty when nothing refused is used. A refused capability with no trigger below (attention, moe, yarn)
        is always in use.
    """
    model_config = getattr(vllm_config, "model_config", None)
    quant = getattr(model_config, "quantization", None) or (
        type(getattr(vllm_config, "quant_config", None)).__name__ if getattr(vllm_config, "quant_config", None)
        else None)
    triggers = {
        "attention_graph": lambda: (f"cudagraph_mode {_full_decode_graphs(vllm_config)}"
                                    if _full_decode_graphs(vllm_config) else None),
        "quantized_moe": lambda: f"quantization {quant}" if quant else None,
        "checkpoint_bf16": lambda: None if quant else "an unquantized checkpoint",
        "checkpoint_mxfp4": lambda: "an MXFP4 checkpoint" if _mxfp4(model_config) else None,
        "atlas_310p": lambda: "an Atlas 310P device" if _is_310p() else None,
        "nz_padding": lambda: None,  # refused nowhere; padding is a patch or native
        "paged_attention_shapes": lambda: (f"pa_shape_list {_pa_shapes(vllm_config)} with cudagraph_mode "
                                           f"{_full_decode_graphs(vllm_config)}"
                                           if _pa_shapes(vllm_config) and _full_decode_graphs(vllm_config) else None),
        "context_parallel": lambda: _context_parallel(vllm_config),
        "model_runner_v2": lambda: _model_runner_v2(vllm_config),
    }
    lines = []
    for name, cap in capabilities.items():
        if cap.get("state") != "refused":
            continue
        used = triggers.get(name, lambda: "always")()
        if used:
            lines.append(f"{name}: {cap.get('note', '')} (in use: {used})")
    return lines


def _model_runner_v2(vllm_config: Any = None) -> str | None:
    """What selects vllm-ascend's model runner v2 for this configuration, or None.

    * ``VLLM_USE_V2_MODEL_RUNNER``: vLLM parses it as ``bool(int(value))`` (``vllm/envs.py``, 0.13 - 0.19), and
      vllm-ascend's worker (``worker/worker.py``), forward context and backend name read it; a value ``int()`` cannot
      read - which vLLM itself rejects - counts as in use, so the guard names it rather than guessing.
    * ``VllmConfig.use_v2_model_runner``, which vllm-ascend's worker reads from 0.23.0rc1 (``worker/worker.py`` L160;
      it forces v1 again with vLLM 0.23.0): what vLLM decides there beyond the variable was not read here (no cell
      runs vLLM >= 0.20), so whenever it says v2 the guard refuses; from 0.27.1rc1 vllm-ascend's
      ``patch_use_v2_model_runner`` makes it the variable alone. A property that raises counts as not set.
    """
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip()
    if value:
        try:
            if int(value):
                return f"VLLM_USE_V2_MODEL_RUNNER={value}"
        except ValueError:
            return f"VLLM_USE_V2_MODEL_RUNNER={value}"
    try:
        selected = getattr(vllm_config, "use_v2_model_runner", None) is True
    except Exception:  # noqa: BLE001 - a half-built configuration: the variable above is what the worker reads then
        selected = False
    return "VllmConfig.use_v2_model_runner (vLLM selected model runner v2 for this model)" if selected else None


def _mxfp4(model_config: Any) -> bool:
    from gptoss_patch.checkpoints import is_gpt_oss_mxfp4

    hf_config = getattr(model_config, "hf_config", None)
    return hf_config is not None and is_gpt_oss_mxfp4(hf_config)


def check_capabilities(status: Any, vllm_config: Any) -> None:
    """Raise :class:`GptOssNotPatchedError` when the configuration uses a capability the row refuses.

    Raises:
        GptOssNotPatchedError: naming each capability, why it is refused and the setting that avoids it.
    """
    if _allowed_unpatched():
        return
    lines = refused_in_use(getattr(status, "capabilities", {}) or {}, vllm_config)
    if not lines:
        return
    head = (f"refusing to build a GPT-OSS model on vllm-ascend {status.versions.get('vllm_ascend')} "
            f"(vllm {status.versions.get('vllm')}): this configuration uses what that release gets wrong for "
            "GPT-OSS.")
    tail = ("  what to do: change the setting named above, or use a release where it is native or patched "
            "(`python -m gptoss_patch.verify --matrix`). GPTOSS_PATCH_ALLOW_UNPATCHED=1 loads anyway (wrong outputs).")
    raise GptOssNotPatchedError("\n".join([head, *(f"  refused: {line}" for line in lines), tail]))


def unpatched_in_use(model: Any, patches: Any) -> list[str]:
    """Objects of ``model`` that will run an upstream method a patch of ours should have wrapped.

    For every applied patch whose target is a method ``module:Class.method``, every submodule of ``model`` - and its
    ``impl`` (vLLM's attention layer holds the backend impl there) and ``quant_method`` (FusedMoE) - whose class
    derives from that ``Class`` must resolve ``method`` (first owner in its MRO) to an object carrying our wrapper's
    marker. A subclass overriding the method (310P attention on vllm-ascend 0.14, a third-party backend) fails.

    Args:
        model: the built ``GptOssForCausalLM`` (a ``torch.nn.Module``).
        patches: ``status().patches``.

    Returns:
        One line per (patch, class) found unpatched, naming a layer, the class and the owner of the method.
    """
    from gptoss_patch.fingerprint import split_target
    from gptoss_patch.registry import APPLIED, MARKER

    targets = []
    for p in patches:
        if p.state != APPLIED:
            continue
        module, qualname = split_target(p.target)
        parts = qualname.split(".")
        if len(parts) == 2:
            targets.append((p.name, module, parts[0], parts[1]))
    if not targets or not hasattr(model, "named_modules"):
        return []
    problems: dict[tuple[str, str], str] = {}
    for layer_name, sub in model.named_modules():
        for obj in (sub, getattr(sub, "impl", None), getattr(sub, "quant_method", None)):
            if obj is None:
                continue
            mro = type(obj).__mro__
            for patch, module, cls_name, method in targets:
                if not any(k.__name__ == cls_name and k.__module__ == module for k in mro):
                    continue
                owner = next((k for k in mro if method in k.__dict__), None)
                attr = owner.__dict__[method] if owner is not None else None
                if attr is not None and getattr(attr, MARKER, None) is None:
                    inner = getattr(attr, "__func__", None)  # staticmethod / classmethod around our wrapper
                    if getattr(inner, MARKER, None) is not None:
                        continue
                    key = (patch, type(obj).__qualname__)
                    problems.setdefault(key, f"{patch}: layer {layer_name or '<model>'} runs "
                                             f"{type(obj).__module__}.{type(obj).__qualname__}.{method} (defined by "
                                             f"{owner.__module__}.{owner.__qualname__}), not the patched "
                                             f"{module}.{cls_name}.{method}")
    return list(problems.values())


def unpatched_functions(patches: Any, layout: str | None) -> list[str]:
    """Module-level function targets of the applied patches (``module:function``, e.g. layout G's
    ``moe_mlp:unquant_apply_mlp``) whose name does not resolve to our wrapper where it is called from: in the target's
    own module (upstream calls it through the module global) and in every module that imported it by value (the
    patch's ``rebind_keys``, read from :data:`gptoss_patch.matrix.LAYOUTS` of ``layout``) and is imported. Such a name
    runs upstream's function although the patch reads *applied* (something re-bound it after us).

    Args:
        patches: ``status().patches``.
        layout: ``status().layout`` (None: no by-value importers to look at).

    Returns:
        One line per (patch, module) found unpatched.
    """
    import sys

    from gptoss_patch import matrix
    from gptoss_patch.fingerprint import split_target
    from gptoss_patch.patches import all_specs
    from gptoss_patch.registry import APPLIED, MARKER

    specs = all_specs()
    keys = matrix.LAYOUTS.get(layout or "", {})
    problems = []
    for p in patches:
        if p.state != APPLIED:
            continue
        module, qualname = split_target(p.target)
        if "." in qualname:
            continue  # Class.method: unpatched_in_use
        spec = specs.get(p.name)
        places = [module, *(keys.get(k) for k in (spec.rebind_keys if spec else ()))]
        for name in filter(None, places):
            mod = sys.modules.get(name)
            obj = mod.__dict__.get(qualname) if mod is not None else None
            if obj is not None and getattr(obj, MARKER, None) != p.name:
                problems.append(f"{p.name}: {name}.{qualname} is {getattr(obj, '__module__', '?')}."
                                f"{getattr(obj, '__qualname__', qualname)}, not the patched function")
    return problems


def p310_in_use(model: Any) -> list[str]:
    """Layers of ``model`` whose attention impl or MoE method comes from vllm-ascend's 310P package
    (``vllm_ascend._310p``: ``AscendAttentionBackendImpl310`` has its own ``forward_impl`` without sinks in every
    release from 0.14.0rc1; docs/upstream.md). One line per class, naming a layer."""
    found: dict[str, str] = {}
    for layer_name, sub in getattr(model, "named_modules", lambda: [])():
        for obj in (getattr(sub, "impl", None), getattr(sub, "quant_method", None)):
            if obj is None:
                continue
            owner = next((k for k in type(obj).__mro__ if k.__module__.startswith("vllm_ascend._310p")), None)
            if owner is not None:
                found.setdefault(owner.__qualname__, f"atlas_310p: layer {layer_name} runs "
                                                     f"{owner.__module__}.{owner.__qualname__}")
    return list(found.values())


def check_runs(model: Any, status: Any) -> None:
    """Raise :class:`GptOssNotPatchedError` when :func:`unpatched_in_use` or :func:`unpatched_functions` finds
    anything, or when the row refuses the 310P and :func:`p310_in_use` finds its classes."""
    if _allowed_unpatched():
        return
    problems = unpatched_in_use(model, status.patches) + unpatched_functions(status.patches, status.layout)
    if (getattr(status, "capabilities", {}) or {}).get("atlas_310p", {}).get("state") == "refused":
        problems += p310_in_use(model)
    if any(p.name == "attention.band_128_keys" and p.state == "applied" for p in status.patches):
        from gptoss_patch.patches.attention import band_problems

        problems += band_problems(model)
    if problems:
        raise GptOssNotPatchedError("\n".join([
            "refusing to serve GPT-OSS: the patches are applied, but some layers bypass them - a subclass of the "
            "patched class, or an impl built outside them (wrong outputs):", *(f"  {p}" for p in problems),
            "  what to do: use the default attention backend and MoE method of vllm-ascend on an Atlas A2/A3 "
            "(910B/910C) card; `python -m gptoss_patch.verify` lists the patches."]))


def check_mxfp4_build(vllm_config: Any, status: Any) -> None:
    """Before a GPT-OSS build (called by the guard): for an MXFP4 checkpoint on a row whose ``checkpoint_mxfp4`` is
    *patched*, both MXFP4 patches must be applied in this process, and a local checkpoint must pass
    :func:`gptoss_patch.checkpoints.check_files`. (A row that refuses MXFP4 is stopped by the guard's capability check.)

    Raises:
        GptOssNotPatchedError: an MXFP4 patch is not applied (named, with its reason).
        gptoss_patch.checkpoints.Mxfp4CheckpointError: the checkpoint's problems, one line per tensor with the
            expected shape.
    """
    from gptoss_patch.checkpoints import Mxfp4CheckpointError, check_files, is_gpt_oss_mxfp4

    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None or not is_gpt_oss_mxfp4(hf_config):
        return
    cap = (getattr(status, "capabilities", {}) or {}).get("checkpoint_mxfp4", {})
    if cap.get("state") != "patched":
        return
    states = (getattr(status, "details", {}) or {}).get("checkpoint_mxfp4", {})
    missing = [f"{name}: {state}" for name, state in states.items() if not state.startswith("applied")]
    if (missing or not states) and not _allowed_unpatched():
        raise GptOssNotPatchedError("\n".join([
            "refusing to build a GPT-OSS model from an MXFP4 checkpoint: the MXFP4 dequantization patches are not "
            "applied in this process (vLLM would reject mxfp4 on NPU or load FP4 bytes as BF16):",
            *(f"  not applied: {m}" for m in missing or ["checkpoint_mxfp4.*: not registered (decision "
                                                         f"{getattr(status, 'decision', None)})"]),
            "  what to do: run `python -m gptoss_patch.verify`; unset GPTOSS_PATCH_DISABLE, or use a BF16 checkpoint"]))
    model = getattr(model_config, "model", None)
    if isinstance(model, str) and os.path.isfile(os.path.join(model, "config.json")):
        problems = check_files(model)
        if problems:
            raise Mxfp4CheckpointError("\n".join([f"the MXFP4 GPT-OSS checkpoint {model} cannot be dequantized "
                                                  "(read from the safetensors headers before loading):",
                                                  *(f"  {p}" for p in problems),
                                                  "  what to do: re-download the named files; `python -m "
                                                  "gptoss_patch.verify --model DIR` checks them"]))



def _guard_init(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``GptOssForCausalLM.__init__``: build, then :func:`check` the status; where our attention
    runs, also fix its operator path (:func:`gptoss_patch.kernels.attention.chosen_path`, which raises
    :class:`~gptoss_patch.kernels.attention.SinkAttentionUnavailable` for a torch_npu without sinks).

    The patches whose modules are imported while the model is built are only applied then, so the check follows the
    build. If the build itself fails on an unpatched stack (vLLM >= 0.12 passes YaRN ``truncate=``, which vllm-ascend
    < 0.15 rejects with ``TypeError``), the guard's error is raised instead, chained to the original one.
    """
    from functools import partial

    from gptoss_patch import _state, evidence
    from gptoss_patch._state import status
    from gptoss_patch.registry import APPLIED, complete_deferred

    current_status = partial(status, drift=False)  # the states only: no fingerprinting in every worker
    complete_deferred()  # a target module another thread was still importing at activation has finished by now
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    check_capabilities(current_status(), vllm_config)
    check_mxfp4_build(vllm_config, current_status())
    check_checkpoint(vllm_config)
    try:
        with _state.building_gpt_oss():  # impl-construction patches (layout I's 128-key band) act on these layers only
            result = wrapped(*args, **kwargs)
    except Exception as exc:
        try:
            check(current_status(), include_pending=False)
        except GptOssNotPatchedError as err:
            raise err from exc
        raise
    _state.gpt_oss_built = True  # gptoss_patch.patches.structured_outputs acts in this process from now on
    status = current_status()
    check(status)
    check_runs(instance, status)
    applied = [p.name for p in status.patches if p.state == APPLIED]
    for cap in ("checkpoint_mxfp4", "checkpoint_bf16", "structured_outputs"):
        applied += [name for name, state in (status.details.get(cap) or {}).items() if state.startswith(APPLIED)]
    evidence.built(applied + (["guard.gpt_oss_model"] if status.details.get("guard", "").startswith(APPLIED) else []))
    if status.decision == "apply" and (status.capabilities or {}).get("attention", {}).get("state") == "patched":
        # the operator path our attention takes, fixed for the process now (layouts B-F did it when the first impl
        # kept its sinks; on H and G upstream keeps them): a torch_npu that cannot compute sinks fails at the build
        from gptoss_patch.kernels import attention as kernels

        kernels.chosen_path()
    return result


#: The guard target (same in every supported vLLM release).
TARGET_MODULE = "vllm.model_executor.models.gpt_oss"
TARGET = f"{TARGET_MODULE}:GptOssForCausalLM.__init__"

#: The guard's patch: armed by :func:`gptoss_patch._activation.activate` on every decision once vllm-ascend is
#: installed (its own registry, apart from the layout's patches).
PATCHES = [PatchSpec("guard.gpt_oss_model", "guard", _guard_init, params=("vllm_config",),
                     summary="building GptOssForCausalLM checks that every GPT-OSS patch is applied")]
