"""gptoss-patch-testkit is its own distribution, pinned to gptoss-patch's version, with a start-up finder held to the
product's start-up rules (issue 28)."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import clean_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_testkit_is_pinned_to_the_same_version():
    from gptoss_patch._version import __version__

    project = tomllib.loads((ROOT / "testkit" / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == "gptoss-patch-testkit" and project["version"] == __version__
    assert f"gptoss-patch=={__version__}" in project["dependencies"]


def test_the_startup_finder_uses_the_standard_library_only_and_almost_nothing():
    """Imported in every interpreter of a test venv: it must not import the simulator, torch or wrapt at start-up,
    and it must serve the simulator only while the switch is on."""
    code = ("import sys, _gptoss_patch_testkit_startup as s; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'wrapt', 'gptoss_patch_testkit')))); "
            "print(s._SimulatedNPUFinder().find_spec('torch_npu'))")
    env = clean_env(PYTHONPATH=str(ROOT / "testkit"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "None"]  # nothing heavy; switch off: the finder steps aside


def test_a_malformed_switch_is_reported_once_and_leaves_the_simulator_off():
    code = ("import _gptoss_patch_testkit_startup as s; f = s._SimulatedNPUFinder(); "
            "print(f.find_spec('torch_npu'), f.find_spec('torchair'))")
    env = clean_env(PYTHONPATH=str(ROOT / "testkit"), GPTOSS_PATCH_SIMULATE_NPU="maybe")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "None"]
    assert len(re.findall("GPTOSS_PATCH_SIMULATE_NPU='maybe' is not a boolean", proc.stderr)) == 1


def test_the_switch_read_at_lookup_serves_the_simulator_in_this_process():
    """Set after start-up, before the first ``import torch_npu``: the simulator serves (tests and jobs rely on it)."""
    code = ("import os; os.environ['GPTOSS_PATCH_SIMULATE_NPU'] = '1'; import torch_npu; "
            "print(torch_npu.__gptoss_simulator__, type(torch_npu.__gptoss_simulator_services__).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "Services"]


def test_a_served_fault_is_named_exactly_or_refused(monkeypatch):
    """A negative control's fault (:mod:`gptoss_patch_testkit.faults`) is installed only by its exact name; a name
    that is no fault raises, so a misspelt control never runs as "no fault"."""
    import pytest

    from gptoss_patch_testkit import faults

    assert faults.env("down_proj_bias_every_rank") == {faults.ENV: "down_proj_bias_every_rank"}
    with pytest.raises(ValueError, match="unknown fault 'down_proj_bias_twice'"):
        faults.env("down_proj_bias_twice")
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.install_from_env() == []
    monkeypatch.setenv(faults.ENV, "swa_mask_template")
    with pytest.raises(ValueError, match="not a known fault: use one of down_proj_bias_every_rank, "
                                         "swa_mask_as_template"):
        faults.install_from_env()


def test_the_api_jobs_reference_cache_builds_the_oracle_only_for_a_new_prompt(tmp_path):
    """``api_job.ReferenceCache``: a prompt decoded once is read back by the next cell's job without building the
    oracle; another oracle or checkpoint has its own file; a new prompt builds it."""
    from gptoss_patch_testkit.jobs.api_job import ReferenceCache

    built = []

    def load():
        built.append(1)
        return "model"

    decode = lambda model, prompt: [model == "model", *prompt, 200002]  # noqa: E731 - a stand-in oracle
    first = ReferenceCache(tmp_path, tmp_path / "harmony-abc", "transformers", load, decode)
    assert first.greedy([5, 6]) == [1, 5, 6, 200002] and len(built) == 1
    first.save()
    again = ReferenceCache(tmp_path, tmp_path / "harmony-abc", "transformers", load, decode)
    assert again.greedy([5, 6]) == [1, 5, 6, 200002] and len(built) == 1  # from the file
    assert again.greedy([7]) == [1, 7, 200002] and len(built) == 2
    other = ReferenceCache(tmp_path, tmp_path / "harmony-abc", "band129", load, decode)
    assert other.path != again.path and other.entries == {}
    assert ReferenceCache(tmp_path, tmp_path / "harmony-xyz", "transformers", load, decode).entries == {}
