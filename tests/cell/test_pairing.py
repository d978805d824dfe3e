"""Both sides of the pairing: the vLLM code GPT-OSS relies on (:data:`gptoss_patch.matrix.VLLM_RELIED`) is checked
like the vllm-ascend targets. The installed (paired) vLLM passes; a vLLM tree whose ``FusedMoE.__init__`` lost
``has_bias`` - read from a copy of the installed files, edited - fails, naming the place; and a vLLM that is not the
paired release is then refused by :func:`gptoss_patch.matrix.decide`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CHECK = """
import json, sys
from gptoss_patch import matrix, pairing
row = next(r for r in matrix.ROWS if r.vllm_ascend == sys.argv[1])
d = matrix.decide(row.vllm_ascend, row.vllm + ".post7", structural_check=pairing.structural_check)
print(json.dumps({"vllm_side": pairing.vllm_structural_check(), "verdict": d.verdict, "reason": d.reason}))
"""


def _relied_files() -> list[str]:
    """The vLLM source files of every VLLM_RELIED location (relative paths), as installed."""
    import importlib.util

    from gptoss_patch import matrix

    root = Path(importlib.util.find_spec("vllm").origin).parent.parent
    files = set()
    for locations, _ in matrix.VLLM_RELIED.values():
        for loc in locations:
            rel = Path(*loc.partition(":")[0].split(".")).with_suffix(".py")
            if (root / rel).is_file():
                files.add(str(rel))
    return sorted(files)


def _check(cell, pythonpath=None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run([sys.executable, "-c", CHECK, cell], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_installed_vllm_passes_and_an_edited_one_is_refused(tmp_path, cell):
    import importlib.util

    installed = _check(cell)
    assert installed["vllm_side"] == [] and installed["verdict"] == "apply", installed
    root = Path(importlib.util.find_spec("vllm").origin).parent.parent
    stub = tmp_path / "site"
    for rel in _relied_files():  # only what the static check reads; nothing is imported
        (stub / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, stub / rel)
    (stub / "vllm" / "__init__.py").write_text("")
    same = _check(cell, stub)
    assert same["vllm_side"] == [], same  # control: the copy itself passes
    layer = stub / "vllm/model_executor/layers/fused_moe/layer.py"
    text = layer.read_text()
    assert text.count("        has_bias: bool = False,\n") == 1
    layer.write_text(text.replace("        has_bias: bool = False,\n", ""))
    edited = _check(cell, stub)
    assert len(edited["vllm_side"]) == 1 and "FusedMoE.__init__" in edited["vllm_side"][0], edited
    assert "has_bias" in edited["vllm_side"][0]
    assert edited["verdict"] == "refuse" and "vLLM side" in edited["reason"]
