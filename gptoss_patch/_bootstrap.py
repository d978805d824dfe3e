"""Interpreter start-up entry of gptoss-patch (run by ``gptoss_patch.pth`` / ``gptoss_patch.start``).

This module runs in *every* Python process on a host where gptoss-patch is installed, so it
is held to three rules:

* standard library only, and only modules the interpreter has already imported at start-up
  (``os``, ``sys``): no ``wrapt``, no ``importlib.metadata``, no ``vllm``, no ``torch``;
* it does almost nothing: it installs one tiny :data:`sys.meta_path` finder that waits for the
  first ``import vllm_ascend`` and then calls :func:`gptoss_patch.activate` (the finder is the
  pattern of virtualenv's ``_virtualenv.pth`` and setuptools' ``distutils-precedence.pth``);
* it never raises: any failure is written as one line to stderr and start-up continues
  (a ``.pth`` line that raises would print a traceback in every ``python`` and ``pip`` run).

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
    in-process switch is not enough; see ``shared/reference/simulator_notes.md``). Any other
    non-empty value except ``0`` is a configuration error.
"""

import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

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
    """Parse a boolean environment variable; raises ValueError naming the variable."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("%s=%r is not a boolean; use 1 or 0" % (name, raw))


class _ActivateOnImport:
    """A :data:`sys.meta_path` finder that never finds anything.

    It watches for the first import of ``vllm_ascend`` and then calls
    :func:`gptoss_patch.activate` (which registers the post-import hooks on the vllm-ascend
    modules we patch) *before* the import proceeds. It stays in ``sys.meta_path`` (removing
    an entry while :mod:`importlib` iterates over that list would make it skip the next
    finder) and costs one string comparison per later import.
    """

    def __init__(self):
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if self.fired or fullname != "vllm_ascend":
            return None
        self.fired = True
        try:
            import gptoss_patch

            gptoss_patch.activate(source="import-hook")
        except BaseException as exc:  # noqa: BLE001 - must never break the user's import
            _report(exc)
        return None

    def invalidate_caches(self):  # noqa: D102 - importlib protocol
        pass

    def __repr__(self):
        return "<gptoss-patch activate-on-import finder fired=%s>" % self.fired


class _SimulatedNPUFinder:
    """A :data:`sys.meta_path` finder that serves the CPU NPU simulator for ``torch_npu``/``torchair``.

    Installed only when ``GPTOSS_PATCH_SIMULATE_NPU=1``. On the first import of either name it
    delegates to :func:`gptoss_patch.testing.npu_sim.install`, which puts the simulated modules
    into :data:`sys.modules` (and refuses when a real ``torch_npu`` is installed).
    """

    names = ("torch_npu", "torchair")

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
