"""One compatibility shim between vLLM 0.11.x and the PyTorch the cells run (2.13 CPU), for piecewise compilation.

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

__all__ = ["install"]


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
