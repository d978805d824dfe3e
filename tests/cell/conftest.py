"""Matrix-cell tests: the real vllm + vllm-ascend wheels of one release, on the CPU NPU simulator.

``GPTOSS_CELL`` names the release (set by the nox session). The simulator is switched on
process-wide (``GPTOSS_PATCH_SIMULATE_NPU=1``) so that every child interpreter - fresh ``python``,
``multiprocessing`` spawn children, vLLM's own helpers - gets it through the ``.pth`` start-up hook.
"""

import os
import subprocess
import sys

import pytest

os.environ["GPTOSS_PATCH_SIMULATE_NPU"] = "1"
for _k in ("GPTOSS_PATCH_DISABLE", "GPTOSS_PATCH_FORCE"):
    os.environ.pop(_k, None)

from gptoss_patch.testing import npu_sim  # noqa: E402

npu_sim.install()

CELL = os.environ.get("GPTOSS_CELL")


def pytest_collection_modifyitems(config, items):
    if CELL is None:
        raise pytest.UsageError("tests/cell runs inside a matrix cell: use `nox -s cell-<release>` "
                                "(GPTOSS_CELL is not set)")


@pytest.fixture(scope="session")
def cell():
    return CELL


def run_python(code: str, **env_overrides) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this cell's venv (activation only through the installed .pth)."""
    env = dict(os.environ)
    for k, v in env_overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
