"""sitecustomize/: activation by PYTHONPATH without the .pth, chaining to the next sitecustomize."""

import subprocess
import sys

from conftest import ROOT, clean_env


def test_pythonpath_activation_and_chaining(tmp_path):
    venv = tmp_path / "venv"  # no gptoss_patch installed in it: the checkout is found through sitecustomize/
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = True\n")
    code = ("import sys, builtins; print(any(getattr(f, '__name__', '') == '_gptoss_patch_hook' for f in sys.meta_path), "
            "getattr(builtins, 'CHAINED', False))")
    env = clean_env(PYTHONPATH=f"{ROOT / 'sitecustomize'}:{other}")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.split() == ["True", "True"]


def test_pythonpath_activation_with_disable_keeps_only_the_guard(tmp_path):
    # GPTOSS_PATCH_DISABLE=1: the finder stays (it arms the GPT-OSS guard on import of vllm-ascend) but
    # activation decides "disabled" and patches nothing (see test_bootstrap for the decision itself).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    code = "import sys; print(any(getattr(f, '__name__', '') == '_gptoss_patch_hook' for f in sys.meta_path))"
    env = clean_env(PYTHONPATH=str(ROOT / "sitecustomize"), GPTOSS_PATCH_DISABLE="1")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "True" and proc.stderr == ""
