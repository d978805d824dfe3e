"""Shims between the upstream releases and the test environment (CPU torch 2.13, no torchvision, no vllm-ascend C
extension), installed with the simulator, never by the product. Each is a property of this environment, not of the NPU;
each changes nothing but the one incompatibility it names:

* :func:`install` - vLLM 0.11's TorchDynamo hook and torch 2.13's extra keyword (below);
* :func:`install_worker_patch_tolerance` - vllm-ascend's worker patches without torchvision;
* :func:`settle_custom_op_probe` - vllm-ascend's ``enable_custom_op()`` answered before any tracing;
* :func:`no_autograd_cache_for_graph_modules` - torch 2.13's AOTAutograd cache and vllm-ascend 0.12's compiler;
* :func:`custom_op_aliasing_warns` - torch 2.13's first-call aliasing check of custom ops, an error when ``CI`` is set.

vLLM 0.11.x was released against torch 2.8. Its ``@support_torch_compile`` decorator
(``vllm/compilation/decorators.py``, 0.11.0) records the files TorchDynamo traces by replacing
``InliningInstructionTranslator.inline_call`` with ``patched_inline_call(parent, func, args, kwargs)``, which
forwards those four arguments to the original. From torch 2.10, Dynamo's ``inline_user_function_return``
(``torch/_dynamo/symbolic_convert.py``) passes one more keyword, ``allow_nested_graph_breaks``, so vLLM 0.11's
replacement raises ``TypeError`` and no model can be compiled. vLLM 0.12+ hooks ``inline_call_`` instead and is not
affected.

The shim wraps ``inline_user_function_return``: when ``inline_call`` is not torch's own (vLLM's replacement is
installed), it calls it with the four arguments vLLM's function accepts; that function then calls torch's original
without the keyword, i.e. with its default, exactly what vLLM 0.11's code does on the torch it was written for.
Nothing else changes. It is a property of the test environment (torch 2.13 instead of torch 2.8 on the NPU host),
installed with the simulator, never by the product.
"""

from __future__ import annotations

__all__ = ["install", "install_worker_patch_tolerance", "settle_custom_op_probe", "no_autograd_cache_for_graph_modules",
           "custom_op_aliasing_warns"]


def _wrap(module) -> None:
    cls = module.InstructionTranslatorBase
    inl = module.InliningInstructionTranslator
    original_call = inl.__dict__["inline_call"]
    method = cls.inline_user_function_return
    if getattr(method, "_gptoss_compat", False):
        return

    def inline_user_function_return(self, fn, args, kwargs, allow_nested_graph_breaks=False):
        current = inl.__dict__.get("inline_call")
        if current is not original_call and not isinstance(current, classmethod):
            cfg = module.config
            if not (cfg.enable_faithful_generator_behavior and module.is_generator(fn.get_code())):
                return inl.inline_call(self, fn, args, kwargs)
        return method(self, fn, args, kwargs, allow_nested_graph_breaks)

    inline_user_function_return._gptoss_compat = True  # type: ignore[attr-defined]
    cls.inline_user_function_return = inline_user_function_return


def install() -> None:
    """Apply the shim when ``torch._dynamo.symbolic_convert`` is imported (now, if it already is); idempotent.
    Only on a torch whose ``inline_call`` has the ``allow_nested_graph_breaks`` keyword."""
    import sys

    def hook(module) -> None:
        import inspect

        target = module.InliningInstructionTranslator.__dict__.get("inline_call")
        fn = getattr(target, "__func__", None)
        if fn is not None and "allow_nested_graph_breaks" in inspect.signature(fn).parameters:
            _wrap(module)

    name = "torch._dynamo.symbolic_convert"
    if name in sys.modules:
        hook(sys.modules[name])
        return
    import wrapt

    wrapt.register_post_import_hook(hook, name)


#: Worker patch statements skipped in this process because they need ``torchvision``, by statement text.
SKIPPED_WORKER_PATCHES: list[str] = []


class _WorkerPatchLoader:
    """Executes ``vllm_ascend/patch/worker/__init__.py`` statement by statement, skipping those whose imports stop
    on a missing ``torchvision`` (see :func:`install_worker_patch_tolerance`)."""

    def __init__(self, origin: str):
        self.origin = origin

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        import ast
        import logging

        source = open(self.origin, encoding="utf-8").read()
        skipped = []
        for node in ast.parse(source, self.origin).body:
            code = compile(ast.Module([node], []), self.origin, "exec")
            try:
                exec(code, module.__dict__)  # noqa: S102 - upstream's own package __init__, one statement at a time
            except ModuleNotFoundError as exc:
                if exc.name != "torchvision":
                    raise
                skipped.append(ast.unparse(node))
        SKIPPED_WORKER_PATCHES.extend(s for s in skipped if s not in SKIPPED_WORKER_PATCHES)
        module.__gptoss_skipped__ = list(skipped)  # read by gptoss_patch.selftest.worker.worker_patch_report
        if skipped:
            logging.getLogger("vllm.gptoss_patch").warning(
                "NPU simulator: vllm-ascend worker patches not applied (they import torchvision, absent here; vision "
                "models only): %s", "; ".join(skipped))


class _WorkerPatchFinder:
    """Meta-path finder serving ``vllm_ascend.patch.worker`` through :class:`_WorkerPatchLoader`."""

    name = "vllm_ascend.patch.worker"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not spec.origin:
            return None
        spec.loader = _WorkerPatchLoader(spec.origin)
        return spec

    def invalidate_caches(self):
        pass


def install_worker_patch_tolerance() -> None:
    """Let vllm-ascend's real worker import its worker patches without ``torchvision`` (idempotent).

    ``vllm_ascend.patch.worker`` (imported by ``NPUWorker.__init__`` through ``adapt_patch()`` and, from 0.13, by
    ``worker/model_runner_v1.py`` at import) imports vision-model patches needing ``torchvision`` from vllm-ascend
    0.12 on; no torchvision release installs beside the cells' CPU torch 2.13.0 (a property of the test environment,
    like the Dynamo shim above). A meta-path finder loads that one package statement by statement, skipping (and
    logging) exactly the statements whose imports stop on ``torchvision``; every other worker patch is applied.
    """
    import sys

    if not any(isinstance(f, _WorkerPatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _WorkerPatchFinder())


def settle_custom_op_probe() -> None:
    """Answer vllm-ascend's ``enable_custom_op()`` once, outside any compiled region (idempotent).

    ``vllm_ascend.utils.enable_custom_op()`` (0.12+) imports the compiled extension ``vllm_ascend.vllm_ascend_C`` on
    its first call and caches the answer. Layers call it from their ``forward`` (e.g. ``AscendRMSNorm.forward_oot``,
    0.13.0), so on a host without the extension the first call can happen while TorchDynamo traces the model, where a
    failing import is a hard error ("Import failure") instead of the ``False`` upstream expects. Calling it as soon as
    ``vllm_ascend.utils`` is imported gives the same cached answer (``False``: the simulator has no vllm-ascend C
    extension, so upstream's pure-PyTorch fallbacks run, as they would eagerly).
    """
    import sys

    def hook(_module) -> None:
        utils = sys.modules.get("vllm_ascend.utils")
        probe = getattr(utils, "enable_custom_op", None)
        if callable(probe):
            probe()

    # vllm_ascend.utils itself imports torch_npu (which installs the simulator) before it defines the probe, so the
    # probe is answered when the modules whose layers call it have been imported (they import vllm_ascend.utils
    # whole), before any model is built.
    import wrapt

    for name in ("vllm_ascend.ops.layernorm", "vllm_ascend.worker.worker_v1", "vllm_ascend.worker.worker"):
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            wrapt.register_post_import_hook(hook, name)


def _on_functorch_config(hook) -> None:
    """Run ``hook(torch._functorch.config)`` now if torch is imported, else when it is (a wrapt post-import hook)."""
    import sys

    name = "torch._functorch.config"
    if name in sys.modules:
        hook(sys.modules[name])
        return
    import wrapt

    wrapt.register_post_import_hook(hook, name)


def custom_op_aliasing_warns() -> None:
    """Make torch 2.13's custom-op aliasing check warn, as it does outside CI, instead of raising when ``CI`` is set.

    torch 2.13's AOTAutograd runtime wrapper runs ``_AnalyzeCustomOpInputOutputMode`` on the first call of a compiled
    graph (``torch/_functorch/_aot_autograd/runtime_wrappers.py``) and flags a custom op whose output is one of its
    inputs. ``torch._functorch.config.error_on_custom_op_aliasing`` decides between a ``UserWarning`` ("deprecated and
    will become an error") and a ``RuntimeError``; its default is ``bool(os.getenv("CI"))``, so the same run passes on a
    developer's shell and fails under a CI runner. vllm-ascend 0.12.0rc1-0.14.0rc1's ``vllm::maybe_pad_and_reduce``
    (``vllm_ascend/ops/register_custom_ops.py``) returns ``tensor_model_parallel_all_reduce(x)``, which at tensor
    parallel size 1 is ``x`` itself, so every PIECEWISE / FULL_DECODE_ONLY start-up of those releases raised under CI.
    The torch these releases were built for (2.8) has no such check; the op's result is the same with either setting.
    An explicit ``TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING`` in the environment is left to win.
    """
    import os

    if "TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING" in os.environ:
        return

    def hook(module) -> None:
        if hasattr(module, "error_on_custom_op_aliasing"):
            module.error_on_custom_op_aliasing = False

    _on_functorch_config(hook)


def no_autograd_cache_for_graph_modules() -> None:
    """Switch off TorchDynamo's AOTAutograd cache (``torch._functorch.config.enable_autograd_cache``) in this process.

    vllm-ascend 0.12.0rc1's graph-fusion compiler (``compilation/compiler_interface.py`` ``fusion_pass_compile``) hands
    ``aot_autograd`` an inner compiler that returns the FX ``GraphModule`` itself. torch 2.13's AOTAutograd cache, on
    by default, accepts only inductor ``OutputCode`` results ("expected OutputCode"), so no model could compile; the
    torch the release was written for did not insist. The cache only saves compile time across processes; results are
    the same without it. A property of the test environment's torch, installed with the simulator.
    """

    def hook(module) -> None:
        if hasattr(module, "enable_autograd_cache"):
            module.enable_autograd_cache = False

    _on_functorch_config(hook)
