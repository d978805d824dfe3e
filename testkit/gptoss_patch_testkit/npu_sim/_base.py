"""Building blocks of the NPU simulator: the not-emulated sentinel and simulated module objects."""

from __future__ import annotations

import types
from typing import Any, Callable


class NotEmulatedError(NotImplementedError):
    """Raised when code calls a ``torch_npu``/``torchair`` operator the simulator does not emulate.

    The message names the operator, so an untested upstream path fails loudly instead of
    silently computing something made up.
    """


class NotEmulated:
    """Stand-in for an attribute the simulator does not provide.

    Attribute access (and ``from torch_npu import X`` at import time) succeeds, because upstream
    modules bind many operators they never call on our paths; *calling* it, or any attribute of it
    (e.g. ``torch_npu.X.out``), raises :class:`NotEmulatedError` naming ``torch_npu.X``.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotEmulatedError(
            f"{self._name} is not emulated by gptoss_patch_testkit.npu_sim; the code path that called it "
            "has no CPU semantics here (add the operator, with its documented semantics, to npu_sim.ops)"
        )

    def __getattr__(self, attr: str) -> "NotEmulated":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return NotEmulated(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<not emulated: {self._name}>"

    def __bool__(self) -> bool:  # `if torch_npu.X:` must not pretend the op exists
        return False


class _NotEmulatedMeta(type):
    def __getattr__(cls, attr: str) -> "NotEmulated":
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return NotEmulated(f"{cls.__gptoss_name__}.{attr}")


def not_emulated_class(name: str) -> type:
    """A stand-in for a class of ``torch_npu``/``torchair`` the simulator does not run.

    Upstream code may import it, read or *replace* its attributes (vllm-ascend's worker patches assign methods of
    torchair's ``npu_fx_compiler._NpuGraphConverter``, used only by the torchair graph compiler); instantiating it
    raises :class:`NotEmulatedError`, and an attribute never assigned is a :class:`NotEmulated` sentinel.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotEmulatedError(f"{name} is not emulated by gptoss_patch_testkit.npu_sim (the torchair graph compiler "
                               "does not run on the simulator)")

    return _NotEmulatedMeta(name.rpartition(".")[2], (), {"__init__": __init__, "__gptoss_name__": name})


def sim_module(name: str, attrs: dict[str, Any] | None = None, package: bool = True) -> types.ModuleType:
    """A module object whose unknown attributes are :class:`NotEmulated` sentinels (PEP 562 ``__getattr__``).

    Args:
        name: fully qualified module name, e.g. ``"torch_npu.npu"``.
        attrs: attributes to set.
        package: give it ``__path__ = []`` so that submodule imports are attempted.
    """
    mod = types.ModuleType(name, f"gptoss-patch NPU simulator stand-in for {name}")
    mod.__gptoss_simulator__ = True
    if package:
        mod.__path__ = []  # type: ignore[attr-defined]

    def __getattr__(attr: str, _name: str = name) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return NotEmulated(f"{_name}.{attr}")

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    for k, v in (attrs or {}).items():
        setattr(mod, k, v)
    return mod


def with_out(functional: Callable[..., Any], out_impl: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Attach an ``.out`` overload to an emulated operator, as torch_npu exposes ``op.out(..., out=[...])``."""
    functional.out = out_impl  # type: ignore[attr-defined]
    functional.__qualname__ = name
    return functional
