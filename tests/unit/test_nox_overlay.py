"""noxfile.py: every nox run installs its checkout into a venv of its own, layered over the shared cached venv
(``overlay_venv``), so two checkouts running nox at once never reinstall into the same cached venv and test each
other's code (issue 17).

The cached venv here is a plain venv holding a marker package and a stale gptoss-patch (``0.0.0+stale`` with its
``.pth``, as an earlier run that installed into the cached venv left it); two copies of this checkout that differ only
in their version (``0.1.0+a`` / ``0.1.0+b``) are installed over it at the same time, each by ``uv`` as the nox sessions
do (``GPTOSS_UV`` names the binary; the unit session sets it)."""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT


def _snapshot(directory: Path) -> dict[str, float]:
    return {str(p.relative_to(directory)): p.stat().st_mtime for p in directory.rglob("*")}


def _checkout(dest: Path, version: str) -> Path:
    """A copy of what the wheel is built from, with ``version``."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "gptoss_patch.pth", "gptoss_patch.start", "_gptoss_patch_hook.py",
                 "_gptoss_patch_hook_loader.py"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "gptoss_patch", dest / "gptoss_patch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "testkit", dest / "testkit", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "gptoss_patch" / "_version.py").write_text(f'__version__ = "{version}"\n')
    return dest


def test_two_checkouts_at_once_install_into_their_own_overlay(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    try:
        noxfile._uv()
    except SystemExit:
        pytest.fail("no uv binary: run through `nox -s unit` (it sets GPTOSS_UV) or pip install uv")
    base = tmp_path / "cached"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base)], check=True)
    base_py = base / "bin" / "python"
    base_site = Path(noxfile._purelib(base_py))
    (base_site / "cellbase_marker.py").write_text("WHERE = 'cached venv'\n")
    stale = base_site / "gptoss_patch"
    shutil.copytree(ROOT / "gptoss_patch", stale, ignore=shutil.ignore_patterns("__pycache__"))
    (stale / "_version.py").write_text('__version__ = "0.0.0+stale"\n')
    shutil.copy(ROOT / "gptoss_patch.pth", base_site / "gptoss_patch.pth")
    shutil.copy(ROOT / "_gptoss_patch_hook.py", base_site / "_gptoss_patch_hook.py")
    before = _snapshot(base)

    sources = {k: _checkout(tmp_path / f"checkout-{k}", f"0.1.0+{k}") for k in ("a", "b")}
    pythons, errors = {}, []

    def install(k):
        try:
            pythons[k] = noxfile.overlay_venv(base_py, sources[k], tmp_path / f"run-{k}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((k, exc))

    threads = [threading.Thread(target=install, args=(k,)) for k in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for k, py in pythons.items():
        out = subprocess.run([str(py), "-c", "import sys; hooked = '_gptoss_patch_hook' in sys.modules\n"
                              "import gptoss_patch, cellbase_marker\n"
                              "print(gptoss_patch.__version__, gptoss_patch.__file__, cellbase_marker.WHERE)\n"
                              "print(hooked)"],
                             capture_output=True, text=True, cwd=tmp_path, env={
                                 k2: v for k2, v in os.environ.items() if not k2.startswith("GPTOSS_PATCH_")})
        assert out.returncode == 0, out.stderr
        version, path, where = out.stdout.splitlines()[0].split(" ", 2)
        hook = subprocess.run([str(py), "-c", "import _gptoss_patch_hook; print(_gptoss_patch_hook.__file__)"],
                              capture_output=True, text=True, cwd=tmp_path).stdout.strip()
        assert Path(hook).is_relative_to(tmp_path / f"run-{k}")  # the overlay's own hook module, not the stale one
        assert version == f"0.1.0+{k}"  # this checkout's code, not the other's nor the cached venv's
        assert Path(path).is_relative_to(tmp_path / f"run-{k}")
        assert where == "cached venv"  # everything else comes from the cached venv
        assert out.stdout.splitlines()[1] == "True"  # the overlay's own gptoss_patch.pth ran at start-up
    assert _snapshot(base) == before  # nothing was installed into (or removed from) the cached venv


def test_stale_cached_venvs_of_the_same_name_are_pruned_and_nothing_else(tmp_path, monkeypatch):
    """A venv of an old key unused for more than STALE_VENV_SECONDS goes; a recent one (another branch may still use
    it), one being built (no marks, fresh directory), this run's, and other names stay."""
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setattr(noxfile, "CACHE", tmp_path)
    old = time.time() - noxfile.STALE_VENV_SECONDS - 60
    venvs = {n: tmp_path / n for n in ("cell-0.18.0-aaaaaaaaaaaa", "cell-0.18.0-bbbbbbbbbbbb",
                                       "cell-0.18.0-cccccccccccc", "cell-0.18.0-dddddddddddd",
                                       "cell-0.18.0rc1-eeeeeeeeeeee", "unit-ffffffffffff")}
    for path in venvs.values():
        path.mkdir()
        (path / ".complete").write_text("[]")
        os.utime(path / ".complete", (old, old))
        os.utime(path, (old, old))
    (venvs["cell-0.18.0-bbbbbbbbbbbb"] / ".last-used").touch()           # used recently
    (venvs["cell-0.18.0-cccccccccccc"] / ".complete").unlink()           # being built now
    os.utime(venvs["cell-0.18.0-cccccccccccc"])

    class _Session:
        def log(self, *_):
            pass

    noxfile.prune_stale_venvs(_Session(), "cell-0.18.0", keep=venvs["cell-0.18.0-dddddddddddd"])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["cell-0.18.0-bbbbbbbbbbbb", "cell-0.18.0-cccccccccccc", "cell-0.18.0-dddddddddddd",
                    "cell-0.18.0rc1-eeeeeeeeeeee", "unit-ffffffffffff"]
