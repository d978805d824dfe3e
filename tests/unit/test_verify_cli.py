"""``python -m gptoss_patch.verify`` command line: machine output of ``--matrix --json`` and usage errors (issue 17).

Each case runs the module in a child interpreter, as a user does; the usage errors return before any stack check.
"""

import json
import subprocess
import sys

import pytest

from conftest import clean_env


def verify(*args, **env):
    return subprocess.run([sys.executable, "-m", "gptoss_patch.verify", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=clean_env(GPTOSS_PATCH_DISABLE="1", **env))


def test_matrix_json_has_typed_values():
    proc = verify("--matrix", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["vllm_ascend"]: r for r in out["rows"]}
    # tested rows (README: "yes (cell-0.11.0)") and untested ones ("no") as booleans
    assert rows["0.11.0"]["tested"] is True and rows["0.11.0"]["cell"] == "cell-0.11.0"
    assert rows["0.11.0rc1"]["tested"] is False and rows["0.11.0rc1"]["cell"] is None
    assert all(isinstance(r["tested"], bool) and isinstance(r["patched"], bool) and isinstance(r["covered"], bool)
               for r in out["rows"])
    assert rows["0.11.0"]["patched"] is True and rows["0.11.0"]["layout"] == "B"
    assert rows["0.15.0rc1"]["patched"] is False and rows["0.15.0rc1"]["covered"] is True
    assert rows["0.15.0rc1"]["layout"] is None  # not the table's "-"
    assert rows["0.11.0rc0"]["covered"] is False and rows["0.11.0rc0"]["verdict"] == "refuse"
    assert rows["0.11.0"]["capabilities"]["moe"]["state"] == "patched"
    assert out["newer_releases"]["verdict"] == "refuse" and out["newer_releases"]["tested"] is False
    assert out["newer_releases"]["after"] == out["rows"][-1]["vllm_ascend"]


@pytest.mark.parametrize("args, option", [
    (["--tensor-parallel-size", "8"], "--tensor-parallel-size"),
    (["--tensor-parallel-size", "8", "--no-children"], "--tensor-parallel-size"),
    (["--server", "http://127.0.0.1:9", "--matrix"], "--matrix"),
    (["--server", "http://127.0.0.1:9", "--matrix", "--json"], "--server"),
    (["--server", "http://127.0.0.1:9", "--model", "m", "--tensor-parallel-size", "8"], "--tensor-parallel-size"),
])
def test_option_combinations_that_mean_nothing_are_usage_errors(args, option):
    proc = verify(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert option in proc.stderr and "error:" in proc.stderr and proc.stdout == ""
