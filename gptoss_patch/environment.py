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
from dataclasses import asdict, dataclass, field
from importlib import metadata

#: Distributions whose versions matter to the decision, by distribution name.
DISTRIBUTIONS = ("vllm", "vllm-ascend", "torch", "torch-npu")

#: Default CANN homes, newest layout first.
_CANN_HOMES = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Versions:
    """Installed versions as strings; ``None`` = not installed; ``cann`` is ``"unknown"`` when absent.

    ``simulated_npu`` is True when the ``torch_npu`` present declares itself a simulator (``__gptoss_simulator__`` on
    the imported module, or on the meta-path finder that will serve it: gptoss-patch-testkit's CPU simulator);
    nothing is imported to find out.
    ``vllm`` is the vLLM version as vllm-ascend sees it: ``VLLM_VERSION`` when set (vllm-ascend's
    ``vllm_version_is`` reads that variable first, ``vllm_ascend/envs.py``), else the installed one, which
    ``vllm_installed`` always holds. ``duplicates`` maps a distribution installed more than once on
    ``sys.path`` (several ``*.dist-info`` of one name) to the paths of its metadata directories.
    """

    vllm: str | None
    vllm_ascend: str | None
    torch: str | None
    torch_npu: str | None
    cann: str
    python: str
    simulated_npu: bool = False
    vllm_installed: str | None = None
    duplicates: dict = field(default_factory=dict)

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


def duplicate_distributions(names=DISTRIBUTIONS) -> dict[str, list[str]]:
    """Distributions of ``names`` with more than one metadata directory on ``sys.path``: name -> paths.

    Two ``vllm-ascend`` dist-infos of different versions (a half-finished upgrade, a ``--target`` copy on
    ``PYTHONPATH``) make the installed version ambiguous: whichever ``importlib.metadata`` finds first need not be
    the code that runs. Metadata of the *same* version in two places (``pip install -e .`` leaves a source-tree
    ``*.egg-info`` beside the installed dist-info) is one installation. Paths are absolute, each with its version.
    """
    out: dict[str, list[str]] = {}
    for name in names:
        found: dict[str, str] = {}  # path -> version
        for dist in metadata.distributions(name=name):
            path = os.path.abspath(str(getattr(dist, "_path", "") or dist.locate_file("")))
            found.setdefault(path, dist.version)
        if len(set(found.values())) > 1:  # an editable checkout's egg-info beside its own dist-info is one install
            out[name] = [f"{path} ({version})" for path, version in found.items()]
    return out


def installed_versions() -> Versions:
    """Collect :class:`Versions` for this interpreter without importing vllm, vllm-ascend or torch."""
    import sys

    # what the torch_npu present says it is: the imported module, or else a meta-path finder that will serve it
    # (gptoss-patch-testkit's start-up finder answers while it serves the simulator); nothing is imported here
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        sim = bool(getattr(mod, "__gptoss_simulator__", False))
    else:
        sim = any(getattr(f, "__gptoss_simulator__", False) is True for f in sys.meta_path)
    installed = distribution_version("vllm")
    override = os.environ.get("VLLM_VERSION") or None
    return Versions(
        vllm=override if override is not None and installed is not None else installed,
        vllm_ascend=distribution_version("vllm-ascend"),
        torch=distribution_version("torch"),
        torch_npu=distribution_version("torch-npu") or distribution_version("torch_npu"),
        cann=cann_version(),
        python=platform.python_version(),
        simulated_npu=sim,
        vllm_installed=installed,
        duplicates=duplicate_distributions(),
    )
