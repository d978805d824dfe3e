"""What the start-up hook hands over to once it has to do more than wait (``_gptoss_patch_hook``, the module
``gptoss_patch.pth`` imports at every interpreter start; this package is imported only from here on).

* :func:`exec_module` - the first ``import vllm_ascend`` (``_gptoss_patch_hook_loader._ActivatingLoader``): activate,
  then run vllm-ascend's own loader;
* :func:`late_install` - the hook's start-up work when ``vllm_ascend`` is already imported (an embedding
  application installing late: activate now) or a start-up variable is set (check it and report a malformed value in
  one line, as ``activate()`` will record it: a *refuse* decision with the guard armed);
* :func:`install` - the hook's entry point for ``sitecustomize``, ``gptoss_patch.start`` (PEP 829) and embedding
  applications (idempotent; never raises).

Never raises: every failure is reported once on stderr (:func:`_report`) and the import goes on.
"""

import os
import sys

__all__ = ["install", "exec_module", "late_install"]


def install() -> None:
    """Install the start-up hook in this interpreter: importing ``_gptoss_patch_hook`` puts it first in
    :data:`sys.meta_path` (once per process; a later call imports nothing). The entry point of ``sitecustomize``, of
    ``gptoss_patch.start`` (PEP 829) and of embedding applications; never raises."""
    try:
        import _gptoss_patch_hook  # noqa: F401 - its import installs it
    except BaseException as exc:  # noqa: BLE001 - never break interpreter start-up
        _report(exc)


def _report(exc, what: str | None = None) -> None:
    """One line about ``exc`` on stderr, once per process (the hook's ``reported`` flag, shared with the hook and its
    loader); ``what``: the line's own text instead of "start-up hook failed (TYPE: exc)"; never raises."""
    try:
        hook = sys.modules.get("_gptoss_patch_hook")
        if hook is not None:
            if hook.reported:
                return
            hook.reported = True
        sys.stderr.write("gptoss-patch: %s; GPT-OSS models will be refused on vllm-ascend until this is fixed.\n"
                         % (what or "start-up hook failed (%s: %s)" % (type(exc).__name__, exc)))
    except BaseException:  # noqa: BLE001 - stderr may be closed; start-up must go on
        pass


def _activate(finder) -> None:
    """Call :func:`gptoss_patch.activate` once per finder (source ``import-hook``); never raises."""
    if finder is not None:
        if finder.fired:
            return
        finder.fired = True
    try:
        import gptoss_patch

        gptoss_patch.activate(source="import-hook")
    except BaseException as exc:  # noqa: BLE001 - must never break the user's import
        _report(exc)


def exec_module(wrapper, module) -> None:
    """Put vllm-ascend's real loader back on ``module`` (``__loader__``, ``__spec__.loader``: nothing keeps the
    wrapper), activate gptoss-patch, then execute the module with its real loader."""
    loader = wrapper._loader
    try:
        if getattr(module, "__loader__", None) is wrapper:
            module.__loader__ = loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is wrapper:
            spec.loader = loader
    except BaseException as exc:  # noqa: BLE001 - must never break the user's import
        _report(exc)
    _activate(wrapper._finder)
    loader.exec_module(module)


def _flag(name: str) -> bool:
    """A boolean variable (:func:`gptoss_patch.config.flag`; raises ValueError naming it); unset or empty is False."""
    if not os.environ.get(name):
        return False
    from gptoss_patch import config

    return config.flag(name)


def late_install(finder) -> None:
    """The hook's start-up work when more than waiting is needed (see the module docstring): ``finder`` is the
    ``_gptoss_patch_hook`` module; never raises."""
    try:
        if "vllm_ascend" in sys.modules:  # e.g. install() called late by an embedding app
            _activate(None)
            return
        sys.meta_path.insert(0, finder)
        # reported here, once, at start-up (GPTOSS_PATCH_DISABLE itself is honoured by activate()): a malformed value
        # is the user's setting, not a failure of the hook, and the line says so
        try:
            _flag("GPTOSS_PATCH_DISABLE")
            _flag("GPTOSS_PATCH_FORCE")
        except ValueError as exc:
            _report(exc, f"a setting is malformed: {exc}")
    except BaseException as exc:  # noqa: BLE001 - never break interpreter start-up
        _report(exc)
