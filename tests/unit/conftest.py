"""Shared fixtures of the unit tests (no upstream wheels needed)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: a long sweep (many replay steps / examples) that `nox -s soak` runs and "
                                       "`nox -s tests` leaves out; the default run keeps a shorter case of it")


def clean_env(**extra):
    """The environment without any GPTOSS_PATCH_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTOSS_PATCH_")}
    env.update(extra)
    return env


@pytest.fixture
def bare_site(tmp_path):
    """A fresh venv (no pip) whose site-packages holds a copy of gptoss_patch, its .pth and hook module, as the wheel
    installs.

    Returns (python, site_packages). Tests may edit the copy (fault injection) without touching the checkout.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shutil.copytree(ROOT / "gptoss_patch", site / "gptoss_patch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "gptoss_patch.pth", site / "gptoss_patch.pth")
    for hook in ("_gptoss_patch_hook.py", "_gptoss_patch_hook_loader.py"):
        shutil.copy(ROOT / hook, site / hook)
    return py, site


def harmony_setup(tmp_path_factory, n_items: int):
    """Generator for module fixtures on the trained harmony model: yields ``(checkpoint dir, the first n_items
    held-out items)`` with the o200k_harmony tokenizer's environment set (undone after the module)."""
    from gptoss_patch.selftest import harmony
    from gptoss_patch.tools import tokenizer

    with pytest.MonkeyPatch.context() as mp:
        for k, v in tokenizer.prepare(tmp_path_factory.mktemp("vocab")).env.items():
            mp.setenv(k, v)
        yield harmony.write_checkpoint(tmp_path_factory.mktemp("harmony"), tokenizer=False), harmony.eval_items(n_items)
