"""The testkit's environment variables, declared into :data:`gptoss_patch.config.VARIABLES` (so the product's parsers
and error messages serve them, :func:`gptoss_patch.config.register`) but owned here: a production server never reads
them.

``GPTOSS_PATCH_SIMULATE_NPU``
    ``1``: ``import torch_npu`` / ``torchair`` resolves to the CPU NPU simulator in every interpreter of a venv with
    the testkit (its start-up finder, ``_gptoss_patch_testkit_startup``), and in every child that inherits it.
``GPTOSS_PATCH_SIM_SOC_VERSION``
    the ACL SoC version number the simulated NPU reports (200-205 Atlas 310P, 220-225 Atlas A2, 250-255 Atlas A3).
``GPTOSS_PATCH_SIM_NPU_MEMORY``, ``GPTOSS_PATCH_SIM_FAULT``, ``GPTOSS_PATCH_SIM_UNINITIALISED``
    the simulated NPU's memory, operator deviations injected by tests, what uninitialised MoE outputs hold.
``GPTOSS_PATCH_WHEEL_CACHE``, ``GPTOSS_PATCH_VENV_CACHE``
    where :mod:`~gptoss_patch_testkit.release_source` keeps downloaded releases; where ``noxfile.py`` keeps the cached
    test environments.
"""

from __future__ import annotations

from typing import Mapping

from gptoss_patch.config import Variable, flag, register

SIMULATE_NPU = "GPTOSS_PATCH_SIMULATE_NPU"
SIM_SOC_VERSION = "GPTOSS_PATCH_SIM_SOC_VERSION"
WHEEL_CACHE = "GPTOSS_PATCH_WHEEL_CACHE"
VENV_CACHE = "GPTOSS_PATCH_VENV_CACHE"
SIM_NPU_MEMORY = "GPTOSS_PATCH_SIM_NPU_MEMORY"
SIM_FAULT = "GPTOSS_PATCH_SIM_FAULT"
SIM_UNINITIALISED = "GPTOSS_PATCH_SIM_UNINITIALISED"

#: SoC version numbers the simulator can identify as (ACL numbers: 200-205 Atlas 310P, 220-225 Atlas A2, 250-255 Atlas A3).
SOC_VERSIONS = tuple(str(n) for n in (*range(200, 206), *range(220, 226), *range(250, 256)))

#: The testkit's variables (listed in testkit/README.md, none in the product README).
TESTKIT_VARIABLES = (
    Variable(SIMULATE_NPU, "bool", readme=False),
    Variable(SIM_SOC_VERSION, "soc", SOC_VERSIONS, readme=False),
    Variable(WHEEL_CACHE, "path", readme=False),    # release_source: downloaded releases
    Variable(VENV_CACHE, "path", readme=False),     # noxfile.py: the cached test environments
    Variable(SIM_NPU_MEMORY, "bytes", default=str(8 << 30), readme=False),  # npu_sim.runtime: capacity
    Variable(SIM_FAULT, "names", ("band129", "drop_sink"), readme=False),  # npu_sim.ops.attention: tests
    # npu_sim.ops.moe: what uninitialised MoE operator outputs hold (NaN, or the dtype's largest finite value)
    Variable(SIM_UNINITIALISED, "choice", ("nan", "finite"), default="nan", readme=False),
)
register(*TESTKIT_VARIABLES)


def soc_version(environ: Mapping[str, str] | None = None) -> int | None:
    """``GPTOSS_PATCH_SIM_SOC_VERSION`` as an int, or None when unset/empty.

    Raises:
        ValueError: not one of :data:`SOC_VERSIONS`.
    """
    import os

    raw = (os.environ if environ is None else environ).get(SIM_SOC_VERSION, "").strip()
    if not raw:
        return None
    if raw not in SOC_VERSIONS:
        raise ValueError(f"{SIM_SOC_VERSION}={raw!r}: use one of {', '.join(SOC_VERSIONS)} "
                         "(ACL SoC version numbers: 200-205 Atlas 310P, 220-225 Atlas A2, 250-255 Atlas A3)")
    return int(raw)


def simulate_npu(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``GPTOSS_PATCH_SIMULATE_NPU`` is on; a malformed value counts as off (for reports, never raises)."""
    try:
        return flag(SIMULATE_NPU, environ)
    except ValueError:
        return False


# the product's parsers, re-exported so testkit modules read every variable through one module
from gptoss_patch.config import CACHE_DIR, VARIABLES, choice, names, path, size_bytes  # noqa: E402,F401
