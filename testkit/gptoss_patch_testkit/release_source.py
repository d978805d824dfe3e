"""The released Python sources of one vllm-ascend version, unpacked for reading (never installed or imported).

Used by ``scripts/update_fingerprints.py`` and ``tests/unit/test_matrix_wheels.py`` to judge every row of the version
matrix from what PyPI really ships:

* a ``cp311`` wheel when PyPI has one (``pip download --no-deps vllm-ascend==X``: pip's own configuration and
  platform tags decide which file);
* otherwise the sdist (``vllm_ascend-X.tar.gz``, e.g. 0.23.0.post1 and 0.27.1rc1 ... 0.30.0rc2, which have no
  cp311 x86_64 wheel), fetched by URL from the package index's JSON simple API (PEP 691) - ``pip download`` of an
  sdist would run its build backend, which needs the CANN toolchain.

Only ``vllm_ascend/**/*.py`` is extracted. Caveat: an sdist need not be what the wheel contains (vllm-ascend
0.21.0rc1's sdist differs from its wheel in 67 files), so the wheel is always preferred.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

from gptoss_patch_testkit import config

#: Default cache of downloaded files and trees (``GPTOSS_PATCH_WHEEL_CACHE`` overrides).
CACHE = Path(config.path(config.WHEEL_CACHE, str(Path.home() / ".cache" / "gptoss-patch" / "wheels")))


def _index_url() -> str:
    """pip's ``index-url`` (``pip config``), else PyPI's simple index."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                         text=True)
    url = out.stdout.strip() if out.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def _download_sdist(release: str, cache: Path) -> Path:
    """``vllm_ascend-<release>.tar.gz`` from the index's JSON simple API into ``cache``.

    Raises:
        RuntimeError: the index lists no sdist for ``release``.
    """
    req = urllib.request.Request(f"{_index_url()}/vllm-ascend/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    name = f"vllm_ascend-{release}.tar.gz"
    entry = next((f for f in files if f["filename"] in (name, f"vllm-ascend-{release}.tar.gz")), None)
    if entry is None:
        raise RuntimeError(f"the index lists neither a cp311 wheel nor an sdist for vllm-ascend {release}")
    target = cache / entry["filename"]
    # a part file of this process's own: two pytest-xdist workers may fetch the same release at once (seen on a cold
    # cache: the second rename found the first's part file gone); os.replace makes the last complete copy win
    import os

    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    with urllib.request.urlopen(entry["url"], timeout=600) as resp, open(part, "wb") as fh:
        fh.write(resp.read())
    os.replace(part, target)
    return target


def release_tree(release: str, cache: Path | None = None) -> Path:
    """A directory holding ``vllm_ascend/`` as released in vllm-ascend ``release`` (downloaded once, cached).

    Returns:
        The directory to put on ``PYTHONPATH`` / hand to :func:`gptoss_patch.drift.fingerprints_in_tree`.

    Raises:
        subprocess.CalledProcessError / RuntimeError / OSError: the release cannot be downloaded.
    """
    cache = CACHE if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"tree-{release}"
    if (root / "vllm_ascend" / "__init__.py").exists():
        return root
    wheels = sorted(cache.glob(f"vllm_ascend-{release}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "--disable-pip-version-check", f"vllm-ascend=={release}", "-d", str(cache)],
                       capture_output=True, timeout=900)
        wheels = sorted(cache.glob(f"vllm_ascend-{release}-*.whl"))
    import tempfile

    staging = Path(tempfile.mkdtemp(prefix=f".tree-{release}-", dir=cache))  # extract aside, then rename: two
    try:                                                                       # processes may ask at once
        if wheels:
            with zipfile.ZipFile(wheels[0]) as zf:
                zf.extractall(staging, [n for n in zf.namelist()
                                        if n.startswith("vllm_ascend/") and n.endswith(".py")])
        else:
            sdists = sorted(cache.glob(f"vllm_ascend-{release}.tar.gz")) or [_download_sdist(release, cache)]
            with tarfile.open(sdists[0]) as tf:
                for member in tf.getmembers():
                    parts = member.name.split("/", 1)
                    if (len(parts) == 2 and parts[1].startswith("vllm_ascend/") and parts[1].endswith(".py")
                            and member.isfile()):
                        member.name = parts[1]
                        tf.extract(member, staging, filter="data")
        try:
            staging.rename(root)
        except OSError:  # another process finished first: its tree is the same files
            if not (root / "vllm_ascend" / "__init__.py").exists():
                raise
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return root
