"""Start-up finder of gptoss-patch-testkit (run by ``gptoss_patch_testkit.pth`` in every interpreter of a venv that
has the testkit installed - never a production server).

Same three rules as the product's start-up hook (``_gptoss_patch_hook``): standard library only (``os`` and
``sys``, already imported at start-up), almost nothing at start-up (one :data:`sys.meta_path` entry), never raises.

The finder answers the first lookup of ``torch_npu``, ``torchair`` or ``acl`` - and only while
``GPTOSS_PATCH_SIMULATE_NPU`` is ``1`` (or ``true``/``yes``/``on``) *at that moment* - by installing the CPU NPU
simulator (:func:`gptoss_patch_testkit.npu_sim.install`) and serving its module objects. Read at lookup time, not at
start-up: a test or a job that sets the variable before its first ``import torch_npu`` gets the simulator in its own
process, and every child interpreter (vLLM's model inspection, its workers) inherits it through the environment. With
the variable unset or ``0`` the finder steps aside and a real ``torch_npu`` (if any) is found as usual; any other value
is reported once on stderr and treated as unset.
"""

import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_reported = False


def _wanted():
    raw = os.environ.get("GPTOSS_PATCH_SIMULATE_NPU", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        global _reported
        if not _reported:
            _reported = True
            try:
                sys.stderr.write("gptoss-patch-testkit: GPTOSS_PATCH_SIMULATE_NPU=%r is not a boolean; use 1 or 0 "
                                 "(the NPU simulator stays off)\n" % raw)
            except BaseException:  # noqa: BLE001 - stderr may be closed
                pass
    return False


class _SimulatedNPUFinder:
    """Serves the CPU NPU simulator for ``torch_npu``/``torchair``/``acl`` while ``GPTOSS_PATCH_SIMULATE_NPU=1``."""

    names = ("torch_npu", "torchair", "acl")

    @property
    def __gptoss_simulator__(self):
        """True while this finder serves the simulator: what ``import torch_npu`` will resolve to, asked by
        ``gptoss_patch.environment.installed_versions`` before anything imported it (no import, no variable name
        known to the product)."""
        return _wanted()

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname.partition(".")[0] not in self.names or not _wanted():
            return None
        from gptoss_patch_testkit import npu_sim

        return npu_sim.find_spec(fullname)

    def invalidate_caches(self):  # noqa: D102 - importlib protocol
        pass

    def __repr__(self):
        return "<simulated-NPU finder of the testkit>"


def install():
    """Put :class:`_SimulatedNPUFinder` first in :data:`sys.meta_path` (idempotent); never raises."""
    try:
        if not any(type(f).__name__ == "_SimulatedNPUFinder" for f in sys.meta_path):
            sys.meta_path.insert(0, _SimulatedNPUFinder())
    except BaseException as exc:  # noqa: BLE001 - never break interpreter start-up
        try:
            sys.stderr.write("gptoss-patch-testkit: start-up finder failed (%s: %s)\n" % (type(exc).__name__, exc))
        except BaseException:  # noqa: BLE001
            pass


install()
