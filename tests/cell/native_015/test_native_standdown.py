"""Activation in a natively supporting cell: gptoss-patch stands down (0.19.1rc1), applies layout H's sliding-window
attention patch (0.15.0rc1, 0.16.0rc1) or layout G's attention and MoE activation patches (0.17.0rc1, 0.18.0), and
tells the user what is still wrong upstream.

Activation comes only through the installed ``.pth`` start-up hook of the cell's venv, in a fresh interpreter
(``conftest.run_python``), the way a deployment sees it; ``python -m gptoss_patch.verify`` must report the row's
verdict and every capability that is not plainly native (the row's ``caps``: ``matrix.cap_lines``, also what
``decide(...).gaps`` returns), and exit 0.
"""

import contextlib
import io
import json
import subprocess
import sys

import pytest
from conftest import ROW, run_python

from gptoss_patch import matrix, verify

CHILD = """
import json, wrapt, gptoss_patch
import vllm_ascend.attention.attention_v1 as aa
import vllm_ascend.ops.fused_moe.moe_mlp as mm
import vllm_ascend.ops.fused_moe.fused_moe as fm
targets = {
    "AscendAttentionBackendImpl.__init__": aa.AscendAttentionBackendImpl.__dict__["__init__"],
    "AscendAttentionBackendImpl.forward": aa.AscendAttentionBackendImpl.__dict__["forward"],
    "AscendAttentionBackendImpl.forward_impl": aa.AscendAttentionBackendImpl.__dict__["forward_impl"],
    "AscendAttentionBackendImpl.forward_fused_infer_attention":
        aa.AscendAttentionBackendImpl.__dict__["forward_fused_infer_attention"],
    "moe_mlp.unquant_apply_mlp": mm.unquant_apply_mlp,
    "moe_mlp.unified_apply_mlp": mm.unified_apply_mlp,
    "AscendUnquantizedFusedMoEMethod.apply": fm.AscendUnquantizedFusedMoEMethod.__dict__["apply"],
}
from gptoss_patch.registry import MARKER
def is_wrapped(v):  # wrapt 2.x: FunctionWrapper is not an ObjectProxy subclass, so check both, and our marker
    return isinstance(v, (wrapt.FunctionWrapper, wrapt.ObjectProxy)) or hasattr(v, MARKER)
probe = wrapt.FunctionWrapper(lambda: None, lambda w, i, a, k: w(*a, **k))  # the check must see a real wrapper
wrapped = sorted(k for k, v in targets.items() if is_wrapped(v))
print("RESULT " + json.dumps({"status": gptoss_patch.status().as_dict(), "wrapped": wrapped,
                              "probe_seen": is_wrapped(probe), "module": aa.__file__}))
"""

#: What each layout of a native row wraps among the child's targets: nothing (stand-down), the sink/window layers'
#: ``forward_impl`` (H), and the MoE activation too (G), the impl's construction (I: the 128-key band).
WRAPPED = {None: [], "H": ["AscendAttentionBackendImpl.forward_impl"],
           "G": ["AscendAttentionBackendImpl.forward_impl", "moe_mlp.unquant_apply_mlp"],
           "I": ["AscendAttentionBackendImpl.__init__"]}
#: ``update_graph_params`` (layouts H and G's ``attention_graph.update_graph_params``) is a staticmethod the child does
#: not list among its targets; its state is in ``want`` below.


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"child gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def test_fresh_interpreter_takes_the_rows_verdict_and_wraps_only_its_patches(cell):
    res = _result(run_python(CHILD))
    st = res["status"]
    assert cell == ROW.vllm_ascend and matrix.native_sinks(ROW)
    assert "/vllm_ascend/attention/attention_v1.py" in res["module"]
    assert st["versions"]["vllm_ascend"] == ROW.vllm_ascend and st["versions"]["vllm"] == ROW.vllm
    assert st["activated"] and st["sources"] == ["import-hook"]
    assert st["decision"] == ROW.verdict and st["row"] == ROW.vllm_ascend
    if ROW.verdict == matrix.STAND_DOWN:
        assert "supports GPT-OSS natively" in st["reason"] and st["patches"] == []
    else:
        assert ROW.layout in ("H", "G", "I") and "is a tested release" in st["reason"]
        want = [("attention.sink_window_forward_impl", "applied",
                 "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.forward_impl"),
                ("attention_graph.update_graph_params", "applied",
                 "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.update_graph_params")]
        if ROW.layout == "I":
            want = [("attention.band_128_keys", "applied",
                     "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.__init__"),
                    ("attention_graph.capture_sinks", "applied",
                     "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.full_graph_fia"),
                    ("attention_graph.update_graph_params", "applied",
                     "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.update_graph_params")]
        if ROW.layout == "G":
            want.append(("moe.activation_name", "applied", "vllm_ascend.ops.fused_moe.moe_mlp:unquant_apply_mlp"))
        assert [(p["name"], p["state"], p["target"]) for p in st["patches"]] == want
    decided = matrix.decide(ROW.vllm_ascend, ROW.vllm)
    assert st["gaps"] == list(decided.gaps) == list(matrix.cap_lines(ROW))
    # every native row still has open GPT-OSS gaps upstream: quantized MoE, 310P, FULL_DECODE_ONLY graphs (up to
    # 0.20.1) and the sliding-window band (docs/upstream.md)
    for cap in ("attention", "attention_graph", "quantized_moe", "atlas_310p"):
        assert any(g.startswith(f"{cap}: ") for g in st["gaps"]), cap
    assert any(g.startswith("moe: patched") for g in st["gaps"]) == (ROW.layout == "G")
    assert any(g.startswith("attention: patched") for g in st["gaps"]) == (ROW.verdict == matrix.APPLY)
    assert res["probe_seen"] is True and res["wrapped"] == WRAPPED[ROW.layout]


@pytest.mark.expensive(90)
def test_verify_reports_the_verdict_and_every_gap_and_exits_0():
    # the testkit's verify: what a user without an NPU runs; on H/G it names where the engine-level check is instead of
    # running the runner's main job (whose rules cover 0.11-0.14), on stand-down rows there is nothing to run
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch_testkit.verify", "--json"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    st = report["status"]
    assert report["ok"] is True and report["problems"] == []
    assert (st["versions"]["vllm_ascend"], st["versions"]["vllm"]) == (ROW.vllm_ascend, ROW.vllm)
    assert st["decision"] == ROW.verdict
    assert st["gaps"] == list(matrix.cap_lines(ROW))
    assert {k: (v["state"], v["note"]) for k, v in st["capabilities"].items()} == \
        {k: (c.state, c.note) for k, c in ROW.caps.items()}
    n_patches = len(matrix.LAYOUT_PATCHES[ROW.layout]) if ROW.verdict == matrix.APPLY else 0
    for label in ("fresh_interpreter", "spawn"):
        child = report["children"][label]
        assert child["decision"] == ROW.verdict and child["ok"], child
        assert sum(p["state"] == "applied" for p in child["patches"]) == n_patches
    if ROW.verdict == matrix.APPLY:
        assert set(report["main_job"]) == {"skipped"}, report["main_job"]
        assert "test_native_serve.py" in report["main_job"]["skipped"]
    else:
        assert "main_job" not in report
    # the table testkit `verify` prints without --json is print_human of this same report (verify.main): rendered
    # here from the JSON rather than by a second run of verify and its three child interpreters
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        verify.print_human(report)
    human = out.getvalue()
    assert f"vllm-ascend {ROW.vllm_ascend} | vllm {ROW.vllm}" in human
    assert f"decision: {ROW.verdict}" in human
    for name, cap in ROW.caps.items():
        if cap.state != matrix.NATIVE:
            assert f"] {name} - {cap.note}" in human, name
    assert f"activation in fresh interpreter: ok ({ROW.verdict}, {n_patches} patches applied)" in human
    assert ("simulated GPT-OSS run: not run here - the runner's rules cover vllm-ascend 0.11-0.14" in human) == \
        (ROW.verdict == matrix.APPLY)
    assert "result: OK" in human
