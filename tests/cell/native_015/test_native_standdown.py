"""Stand-down in the 0.15.0rc1 cell: vllm-ascend supports GPT-OSS natively, so gptoss-patch patches nothing.

Activation comes only through the installed ``.pth`` start-up hook of the cell's venv, in a fresh interpreter
(``conftest.run_python``), the way a deployment sees it; ``python -m gptoss_patch.verify`` must tell the user
the native-support verdict and the GPT-OSS gaps still open upstream in this release, and exit 0.
"""

import json
import subprocess
import sys

from conftest import run_python
from packaging.version import Version

from gptoss_patch import matrix

CHILD = """
import json, wrapt, gptoss_patch
import vllm_ascend.attention.attention_v1 as aa
import vllm_ascend.ops.fused_moe.moe_mlp as mm
import vllm_ascend.ops.fused_moe.fused_moe as fm
targets = {
    "AscendAttentionBackendImpl.__init__": aa.AscendAttentionBackendImpl.__dict__["__init__"],
    "AscendAttentionBackendImpl.forward": aa.AscendAttentionBackendImpl.__dict__["forward"],
    "AscendAttentionBackendImpl.forward_fused_infer_attention":
        aa.AscendAttentionBackendImpl.__dict__["forward_fused_infer_attention"],
    "moe_mlp.unquant_apply_mlp": mm.unquant_apply_mlp,
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


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"child gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def test_fresh_interpreter_stands_down_and_wraps_nothing(cell):
    res = _result(run_python(CHILD))
    st = res["status"]
    assert cell == "0.15.0rc1"
    assert "/vllm_ascend/attention/attention_v1.py" in res["module"]
    assert st["versions"]["vllm_ascend"] == "0.15.0rc1" and st["versions"]["vllm"] == "0.15.0"
    assert st["activated"] and st["sources"] == ["import-hook"]
    assert st["decision"] == "stand-down" and "supports GPT-OSS natively" in st["reason"]
    assert st["patches"] == []
    assert st["gaps"] == [g.text for g in matrix.gaps_for(Version("0.15.0rc1"))] and len(st["gaps"]) == 4
    assert res["probe_seen"] is True and res["wrapped"] == []


def test_verify_prints_the_native_verdict_and_the_gaps_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify"], capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-2000:]
    assert "vllm-ascend 0.15.0rc1 | vllm 0.15.0" in out
    assert "decision: stand-down" in out and "supports GPT-OSS natively" in out and "no longer need it" in out
    for gap in matrix.gaps_for(Version("0.15.0rc1")):
        assert f"upstream gap still open in this release: {gap.text}" in out
    assert "activation in fresh interpreter: ok (stand-down, 0 patches applied)" in out
    assert "activation in spawn: ok (stand-down, 0 patches applied)" in out
    assert "result: OK" in out
