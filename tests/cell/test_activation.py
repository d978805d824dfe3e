"""Issue 2 in a real cell: activation through the .pth, the vLLM plugin, spawn and fork children, DISABLE,
and the first real patch (AscendAttentionBackendImpl keeps ``sinks``)."""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_python
from gptoss_patch import matrix
from gptoss_patch.patches import all_specs

IMPL_ARGS = "8, 64, 0.125, 1, None, 128, 'auto', None, 'decoder', None"

CHILD = f"""
import importlib, json, torch, gptoss_patch
from vllm.config import VllmConfig, set_current_vllm_config
import vllm_ascend.attention.attention_v1 as aa
sinks = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16), requires_grad=False)
with set_current_vllm_config(VllmConfig()):  # vllm-ascend 0.14's impl reads it
    impl = aa.AscendAttentionBackendImpl({IMPL_ARGS}, sinks=sinks)
for p in gptoss_patch.status().patches:  # what a worker imports while building the model
    importlib.import_module(p.target.split(":")[0])
s = gptoss_patch.status()
print("RESULT " + json.dumps({{"status": s.as_dict(), "kept": getattr(impl, "sinks", "MISSING") is sinks,
                              "has_attr": hasattr(impl, "sinks")}}))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"child gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def fresh_child():
    """``CHILD`` in a fresh interpreter (activation through the .pth only), run once for the tests reading it."""
    return _result(run_python(CHILD))


@pytest.mark.xdist_group("verify")
def test_fresh_interpreter_applies_and_keeps_sinks(cell, layout, fresh_child):
    res = fresh_child
    st = res["status"]
    assert st["decision"] == "apply" and st["row"] == cell and st["ok"]
    assert st["sources"] == ["import-hook"]
    assert all(p["state"] == "applied" for p in st["patches"])
    assert [p["name"] for p in st["patches"]] == list(matrix.LAYOUT_PATCHES[layout])
    assert [p["target"] for p in st["patches"]] == [
        matrix.LAYOUTS[layout][all_specs()[n].target_key] for n in matrix.LAYOUT_PATCHES[layout]]
    assert res["kept"] is True
    # the installed release is a tested one: every wrapped target is the code that release shipped
    for p in st["patches"]:
        assert p["drift"].startswith("tested code (as shipped in ") and cell in p["drift"][len("tested code (as shipped in "):-1].split(", "), p


def test_fingerprint_table_matches_the_installed_release(cell, layout):
    from gptoss_patch import drift
    from gptoss_patch.fingerprint import fingerprint

    stored = drift.table()[cell]
    targets = drift.all_targets()
    live = {t: fingerprint(t) for t in targets}
    assert {t: fp for t, fp in live.items() if fp is not None} == stored
    assert all(live[t] for t in matrix.LAYOUTS[layout].values() if ":" in t)


EDIT_TARGET = "attention_impl_init"


def test_an_edited_release_is_reported_as_untested_code_and_still_applied(tmp_path, layout):
    """Drift: a copy of the installed vllm_ascend with one target's body edited (same signature)."""
    import ast
    import importlib.util
    import shutil

    target = matrix.LAYOUTS[layout][EDIT_TARGET]
    module, qualname = target.split(":")
    src_root = Path(importlib.util.find_spec("vllm_ascend").origin).parent
    shutil.copytree(src_root, tmp_path / "vllm_ascend", symlinks=True)
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    lines = path.read_text().splitlines(keepends=True)
    node = ast.parse("".join(lines))
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part)
    first = node.body[0]
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}_locally_edited = True  # a site-local hotfix\n")
    path.write_text("".join(lines))
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--json", "--no-children"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    report = json.loads(proc.stdout)
    patches = {p["target"]: p for p in report["status"]["patches"]}
    edited = patches[target]
    assert edited["state"] == "applied"  # the structural check passed: applied, and marked
    assert edited["drift"].startswith("untested code: fingerprint") and "matches no release" in edited["drift"]
    assert any(target in w and "untested code" in w for w in report["warnings"])
    others = [p for t, p in patches.items() if t != target]
    assert others and all(p["drift"].startswith("tested code") for p in others)
    assert report["status"]["decision"] == "apply" and report["ok"] and proc.returncode == 0
    human = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--no-children"], capture_output=True,
                           text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert f"warning: patch {edited['name']} wraps {target}: untested code" in human.stdout


def test_disable_leaves_upstream_untouched_and_upstream_drops_sinks():
    res = _result(run_python(CHILD, GPTOSS_PATCH_DISABLE="1"))
    assert res["status"]["decision"] == "disabled" and res["status"]["patches"] == []
    assert res["has_attr"] is False  # the real upstream bug: sinks vanish into **kwargs
    assert res["status"]["details"]["guard"].startswith("pending")  # armed, waiting for the GPT-OSS model module


WRAP_LAYERS = """
import json, gptoss_patch, wrapt
{first}
import vllm_ascend.attention.attention_v1 as aa
{then}
from gptoss_patch.verify import import_patch_targets
assert import_patch_targets() is None  # the MoE / graph modules too (0.12+: not imported by attention_v1)
init = aa.AscendAttentionBackendImpl.__dict__["__init__"]
layers = 0
while isinstance(init, wrapt.FunctionWrapper):
    layers += 1
    init = init.__wrapped__
s = gptoss_patch.status()
print("RESULT " + json.dumps({{"sources": s.sources, "layers": layers, "ok": s.ok}}))
"""


def test_plugin_then_pth_wraps_once():
    # the entry point called before anything imports vllm_ascend, then the .pth finder fires on the import
    res = _result(run_python(WRAP_LAYERS.format(first="from gptoss_patch import plugin; plugin.register()",
                                                then="")))
    assert res["sources"] == ["vllm-plugin", "import-hook"]
    assert res["layers"] == 1 and res["ok"]


def test_vllm_loads_our_general_plugin_and_it_wraps_once():
    # vLLM's own loader finds the vllm.general_plugins entry point of the installed wheel
    res = _result(run_python(WRAP_LAYERS.format(
        first="", then="from vllm.plugins import load_general_plugins; load_general_plugins()")))
    assert res["sources"] == ["import-hook", "vllm-plugin"]
    assert res["layers"] == 1 and res["ok"]


def _child_builds_impl(queue):
    import importlib

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    import gptoss_patch
    import vllm_ascend.attention.attention_v1 as aa

    sinks = torch.randn(8)
    with set_current_vllm_config(VllmConfig()):
        impl = aa.AscendAttentionBackendImpl(8, 64, 0.125, 1, None, 128, "auto", None, "decoder", None, sinks=sinks)
    for p in gptoss_patch.status().patches:
        importlib.import_module(p.target.split(":")[0])
    queue.put({"kept": getattr(impl, "sinks", None) is sinks, "decision": gptoss_patch.status().decision,
               "states": [p.state for p in gptoss_patch.status().patches]})


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_multiprocessing_children_are_patched(method):
    import vllm_ascend.attention.attention_v1  # noqa: F401 - activates in this process (fork inherits it)

    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_builds_impl, args=(queue,))
    proc.start()
    res = queue.get(timeout=600)
    proc.join(60)
    assert proc.exitcode == 0
    assert res["kept"] is True and res["decision"] == "apply"
    assert res["states"] and set(res["states"]) == {"applied"}


def test_layer_without_sinks_gets_none_and_bad_sinks_are_rejected_naming_the_layer():
    import vllm_ascend.attention.attention_v1 as aa
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vllm-ascend 0.14's impl reads it
        impl = aa.AscendAttentionBackendImpl(8, 64, 0.125, 1, None, None, "auto", None, "decoder", None)
        assert impl.sinks is None
        with pytest.raises(ValueError, match=r"num_heads=8.*sliding_window=128.*shape \[8\].*got \[16\]"):
            aa.AscendAttentionBackendImpl(8, 64, 0.125, 1, None, 128, "auto", None, "decoder", None,
                                          sinks=torch.zeros(16))
        with pytest.raises(TypeError, match="floating point"):
            aa.AscendAttentionBackendImpl(8, 64, 0.125, 1, None, 128, "auto", None, "decoder", None,
                                          sinks=torch.zeros(8, dtype=torch.int32))


def test_status_and_verify_json_agree(verify_simulate, fresh_child):
    # verify_simulate (conftest): the one `testkit verify --json` run of the session - in a cell, the testkit's verify
    # only adds the main job to what `verify --json` reports (the NPU is simulated process-wide already)
    proc, report = verify_simulate
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    fresh = fresh_child["status"]
    for key in ("decision", "reason", "row", "versions", "ok"):
        assert report["status"][key] == fresh[key], key
    assert [(p["name"], p["target"], p["state"], p["fingerprint"]) for p in report["status"]["patches"]] == \
        [(p["name"], p["target"], p["state"], p["fingerprint"]) for p in fresh["patches"]]
    assert set(report["children"]) == {"fresh_interpreter", "spawn", "forkserver"}
    for child in report["children"].values():
        assert child["ok"] and child["decision"] == "apply"


def test_forkserver_child_activates_through_the_pth(cell, layout):
    """``VLLM_WORKER_MULTIPROC_METHOD=forkserver``: a worker forked from vLLM's fork server (itself a fresh interpreter)
    activates through the .pth hook as a spawned one does, with every patch of the layout applied (issue 17)."""
    from gptoss_patch.verify import spawn_child_status

    d = spawn_child_status(method="forkserver")
    assert "error" not in d, d
    assert d["decision"] == "apply" and d["row"] == cell and d["ok"] and not d["import_error"]
    assert d["sources"] == ["import-hook"]
    assert [p["name"] for p in d["patches"]] == list(matrix.LAYOUT_PATCHES[layout])
    assert all(p["state"] == "applied" for p in d["patches"])


def test_verify_exit_status_when_stack_not_covered(tmp_path):
    # vllm-ascend invisible to importlib.metadata and to import: verify must say so plainly and exit 1
    code = ("import sys, importlib.metadata as md\n"
            "orig = md.version\n"
            "def version(name):\n"
            "    if name == 'vllm-ascend': raise md.PackageNotFoundError(name)\n"
            "    return orig(name)\n"
            "md.version = version\n"
            "from gptoss_patch import verify\n"
            "sys.exit(verify.main(['--no-children']))\n")
    proc = run_python(code)
    assert proc.returncode == 1
    assert "vllm-ascend is not installed" in proc.stdout
    usage = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--bogus"], capture_output=True, text=True)
    assert usage.returncode == 2
