"""What is installed: package versions (read without importing the packages) and the CANN version.

Sources of the facts:

* Python distributions: :func:`importlib.metadata.version` reads ``*.dist-info/METADATA``; nothing
  is imported, so asking costs no ``torch``/``vllm`` import.
* CANN: the toolkit writes ``version=<x>`` into ``<home>/<arch>-linux/ascend_toolkit_install.info``
  (Huawei CANN installation guide, "check CANN installation": ``cat
  /usr/local/Ascend/cann/<arch>-linux/ascend_toolkit_install.info``; older toolkits use
  ``/usr/local/Ascend/ascend-toolkit/latest``). ``<home>`` is taken from ``ASCEND_HOME_PATH`` or
  ``ASCEND_TOOLKIT_HOME`` (exported by the toolkit's ``set_env.sh``), else the default paths.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from importlib import metadata

#: Distributions whose versions matter to the decision, by distribution name.
DISTRIBUTIONS = ("vllm", "vllm-ascend", "torch", "torch-npu")

#: Default CANN homes, newest layout first.
_CANN_HOMES = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Versions:
    """Installed versions as strings; ``None`` = not installed; ``cann`` is ``"unknown"`` when absent.

    ``simulated_npu`` is True when ``torch_npu`` is served by :mod:`gptoss_patch.testing.npu_sim`.
    """

    vllm: str | None
    vllm_ascend: str | None
    torch: str | None
    torch_npu: str | None
    cann: str
    python: str
    simulated_npu: bool = False

    def as_dict(self) -> dict:
        """JSON-ready dict of the fields."""
        return asdict(self)


def distribution_version(name: str) -> str | None:
    """Version string of the installed distribution ``name`` (e.g. ``"vllm-ascend"``), or None if absent."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cann_version(environ: dict | None = None) -> str:
    """CANN toolkit version read from ``ascend_toolkit_install.info``, or ``"unknown"``.

    Args:
        environ: mapping to read ``ASCEND_HOME_PATH``/``ASCEND_TOOLKIT_HOME`` from (default ``os.environ``).

    Never raises: an unreadable or malformed file gives ``"unknown"``.
    """
    env = os.environ if environ is None else environ
    homes = [env.get("ASCEND_HOME_PATH"), env.get("ASCEND_TOOLKIT_HOME"), *_CANN_HOMES]
    arch = platform.machine() or "x86_64"
    for home in homes:
        if not home:
            continue
        for rel in (f"{arch}-linux/ascend_toolkit_install.info", "ascend_toolkit_install.info"):
            path = os.path.join(home, rel)
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        key, sep, value = line.partition("=")
                        if sep and key.strip().lower() == "version" and value.strip():
                            return value.strip()
            except OSError:
                continue
    return UNKNOWN


def installed_versions() -> Versions:
    """Collect :class:`Versions` for this interpreter without importing vllm, vllm-ascend or torch."""
    import sys

    sim = False
    mod = sys.modules.get("torch_npu")
    if mod is not None and getattr(mod, "__gptoss_simulator__", False):
        sim = True
    elif os.environ.get("GPTOSS_PATCH_SIMULATE_NPU", "").strip().lower() in ("1", "true", "yes", "on"):
        sim = True
    return Versions(
        vllm=distribution_version("vllm"),
        vllm_ascend=distribution_version("vllm-ascend"),
        torch=distribution_version("torch"),
        torch_npu=distribution_version("torch-npu") or distribution_version("torch_npu"),
        cann=cann_version(),
        python=platform.python_version(),
        simulated_npu=sim,
    )
