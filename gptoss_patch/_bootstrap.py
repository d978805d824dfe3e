"""Interpreter start-up entry of gptoss-patch (run by ``gptoss_patch.pth`` / ``gptoss_patch.start``).

This module runs in *every* Python process on a host where gptoss-patch is installed, so it
is held to three rules:

* standard library only, and only modules the interpreter has already imported at start-up
  (``os``, ``sys``): no ``wrapt``, no ``importlib.metadata``, no ``vllm``, no ``torch``;
* it does almost nothing: it installs one tiny :data:`sys.meta_path` finder that waits for the
  first ``import vllm_ascend`` and then calls :func:`gptoss_patch.activate` (the finder is the
  pattern of virtualenv's ``_virtualenv.pth`` and setuptools' ``distutils-precedence.pth``);
* it never raises: any failure is written as one line to stderr and start-up continues
  (a ``.pth`` line that raises would print a traceback in every ``python`` and ``pip`` run). The
  ``.pth`` line itself stays silent when the package is gone but the ``.pth`` was left behind: it
  catches the ``ImportError`` of ``gptoss_patch``/``gptoss_patch._bootstrap`` (a ``try`` compiled by
  ``exec``, ~0.05 ms; asking ``importlib.util.find_spec`` first would import ``importlib.util``, ~7 ms).

Environment variables (read once, at start-up):

``GPTOSS_PATCH_DISABLE``
    ``1``/``true``/``yes``/``on``: no patch in this process tree. The finder is still installed so that,
    in processes that import vllm-ascend, building a GPT-OSS model meets the guard
    (:mod:`gptoss_patch.patches.guard`) instead of serving garbage. The simulator switch below works
    either way, so tests can run upstream's unpatched code on the simulator.
``GPTOSS_PATCH_SIMULATE_NPU``
    ``1``: make ``torch_npu`` and ``torchair`` resolve to the CPU NPU simulator
    (:mod:`gptoss_patch.testing.npu_sim`) in this interpreter and every child that inherits the
    environment (vLLM inspects models in child interpreters and starts worker processes, so an
    in-process switch is not enough; see ``docs/simulator.md`` §1). Any other
    non-empty value except ``0`` is a configuration error.
"""

import os
import sys

#: Set once the start-up work ran (or was skipped); :func:`install` is idempotent.
_installed = False
#: Errors are reported once per process.
_reported = False


def _report(exc):
    """Write one line about ``exc`` to stderr, once per process; never raises."""
    global _reported
    if _reported:
        return
    _reported = True
    try:
        sys.stderr.write(
            "gptoss-patch: start-up hook failed (%s: %s); GPT-OSS models will be refused on vllm-ascend "
            "until this is fixed.\n" % (type(exc).__name__, exc)
        )
    except BaseException:  # noqa: BLE001 - stderr may be closed; start-up must go on
        pass


def _flag(name):
    """A boolean variable (:func:`gptoss_patch.config.flag`; raises ValueError naming it). Unset or empty is False
    without importing anything: the common case costs one dictionary lookup at start-up."""
    if not os.environ.get(name):
        return False
    from gptoss_patch import config

    return config.flag(name)


class _ActivateOnImport:
    """A :data:`sys.meta_path` finder that activates gptoss-patch on the first import of ``vllm_ascend``.

    It finds nothing itself. For ``vllm_ascend`` it asks the finders after it for the real spec and
    returns that spec with its loader wrapped in :class:`_ActivatingLoader`, whose ``exec_module``
    calls :func:`gptoss_patch.activate` (which registers the post-import hooks on the vllm-ascend
    modules we patch) and then runs the real loader: activation happens before any code of
    vllm-ascend runs, but *not* inside ``find_spec``, where importlib holds its global import lock
    (``_ImportLockContext`` in ``importlib._bootstrap._find_spec``). Activating under that lock
    deadlocked against another thread whose first ``gptoss_patch.activate()``/``status()`` was importing
    ``gptoss_patch._activation`` (it held that module's lock and waited for the global one).

    It stays in ``sys.meta_path`` (removing an entry while :mod:`importlib` iterates over that list
    would make it skip the next finder) and costs one string comparison per later import.
    """

    def __init__(self):
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if self.fired or fullname != "vllm_ascend":
            return None
        try:
            spec = self._next_spec(fullname, path, target)
            loader = getattr(spec, "loader", None)
            if loader is None:  # not found (importlib reports it) or a namespace portion without a loader
                return None
            if not hasattr(loader, "exec_module"):  # a legacy loader: activate here, as before (rare)
                self.activate()
                return None
            spec.loader = _ActivatingLoader(self, loader)
            return spec
        except BaseException as exc:  # noqa: BLE001 - must never break the user's import
            _report(exc)
            return None

    def _next_spec(self, fullname, path, target):
        """The spec the finders after this one in :data:`sys.meta_path` give (None if none does)."""
        after = False
        for finder in list(sys.meta_path):
            if finder is self:
                after = True
            elif after:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    return spec
        return None

    def activate(self):
        """Call :func:`gptoss_patch.activate` once (source ``import-hook``); never raises."""
        if self.fired:
            return
        self.fired = True
        try:
            import gptoss_patch

            gptoss_patch.activate(source="import-hook")
        except BaseException as exc:  # noqa: BLE001 - must never break the user's import
            _report(exc)

    def invalidate_caches(self):  # noqa: D102 - importlib protocol
        pass

    def __repr__(self):
        return "<gptoss-patch activate-on-import finder fired=%s>" % self.fired


class _ActivatingLoader:
    """Wraps the real loader of ``vllm_ascend``: ``exec_module`` activates gptoss-patch, then delegates.

    Runs under the module's own import lock only. Before activating it puts the real loader back on
    the module (``__loader__``, ``__spec__.loader``), so nothing keeps a reference to this wrapper.
    Other attributes (``get_code``, ``get_resource_reader``, ...) are the real loader's.
    """

    def __init__(self, finder, loader):
        self._finder = finder
        self._loader = loader

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):  # noqa: D102 - importlib protocol
        loader = self._loader
        try:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = loader
        except BaseException as exc:  # noqa: BLE001 - must never break the user's import
            _report(exc)
        self._finder.activate()
        loader.exec_module(module)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_loader", "_finder"):
            raise AttributeError(name)
        return getattr(self._loader, name)


class _SimulatedNPUFinder:
    """A :data:`sys.meta_path` finder that serves the CPU NPU simulator for ``torch_npu``/``torchair``.

    Installed only when ``GPTOSS_PATCH_SIMULATE_NPU=1``. On the first import of either name it
    delegates to :func:`gptoss_patch.testing.npu_sim.install`, which puts the simulated modules
    into :data:`sys.modules` (and refuses when a real ``torch_npu`` is installed).
    """

    names = ("torch_npu", "torchair", "acl")

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        top = fullname.partition(".")[0]
        if top not in self.names:
            return None
        from gptoss_patch.testing import npu_sim

        return npu_sim.find_spec(fullname)

    def invalidate_caches(self):  # noqa: D102 - importlib protocol
        pass


def install():
    """Install the start-up hooks for this interpreter; idempotent; never raises.

    Called by the one line of ``gptoss_patch.pth`` (and, on Python >= 3.15, by the entry point
    in ``gptoss_patch.start``, PEP 829). Returns None.
    """
    global _installed
    if _installed:
        return
    _installed = True
    try:
        if _flag("GPTOSS_PATCH_SIMULATE_NPU"):  # a test facility, independent of the patches
            sys.meta_path.insert(0, _SimulatedNPUFinder())
        if "vllm_ascend" in sys.modules:  # e.g. install() called late by an embedding app
            import gptoss_patch

            gptoss_patch.activate(source="import-hook")
            return
        # Installed whatever the other variables say: activate() records a malformed value as a *refuse*
        # decision and arms the GPT-OSS guard, so a typo can never leave GPT-OSS unpatched and unguarded.
        sys.meta_path.insert(0, _ActivateOnImport())
        # Reported here too, once, at start-up (GPTOSS_PATCH_DISABLE is honoured by activate()).
        _flag("GPTOSS_PATCH_DISABLE")
        _flag("GPTOSS_PATCH_FORCE")
    except BaseException as exc:  # noqa: BLE001 - never break interpreter start-up
        _report(exc)
