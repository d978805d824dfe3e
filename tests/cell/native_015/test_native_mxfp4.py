"""MXFP4 checkpoints on the native releases (0.15.0rc1 ... 0.19.1rc1): vLLM's own loader and vllm-ascend's native
MoE on the simulator, from a tiny GPT-OSS written in the official MXFP4 layout, against transformers' dequantization of
the same files (``integrations/mxfp4.py`` ``convert_moe_packed_tensors``).

Each case runs in a fresh interpreter (the cell's process-wide vLLM context belongs to the BF16 checkpoint of the
other calibration tests): activation through the installed ``.pth`` only, as in a deployment.

* With gptoss-patch (the row's ``checkpoint_mxfp4: patched``): vLLM configures the model unquantized, the loaded
  expert weights equal transformers' dequantized tensors bit for bit, and every MoE layer equals transformers'
  ``GptOssMLP`` of the dequantized model (float32 relative error <= 1e-4, the bound of ``test_native_moe.py``).
* Without it (``GPTOSS_PATCH_DISABLE=1`` + ``GPTOSS_PATCH_ALLOW_UNPATCHED=1``): vLLM rejects the checkpoint at
  configuration (``mxfp4`` is not among vllm-ascend's ``supported_quantization``), so the equality above is the
  patch's doing.
"""

import json

from conftest import ROW, run_python

from gptoss_patch import matrix

CHILD = """
import json, sys
import torch
import gptoss_patch
from gptoss_patch.testing import native_015 as n015, vllm_setup
from gptoss_patch.testing.tiny import write_checkpoint
from gptoss_patch.testing.runner import _transformers_mxfp4_model
ckpt = write_checkpoint(vllm_setup.process_scratch("gptoss-mxfp4-"), preset="tiny-mxfp4", seed=0, tokenizer=False,
                        quantization="mxfp4")
out = {}
try:
    cfg, _ = n015.vllm_context(str(ckpt))
except Exception as exc:
    print("MX-RESULT " + json.dumps({"config_error": type(exc).__name__ + ": " + str(exc)[:400]}))
    sys.exit(0)
out["quantization"] = cfg.model_config.quantization
native = n015.load_native_model(cfg)
hf = _transformers_mxfp4_model(ckpt).eval()
exact = []
for i in range(4):
    ex, ref = native.model.model.layers[i].mlp.experts, hf.model.layers[i].mlp.experts
    for mine, want in ((ex.w13_weight, ref.gate_up_proj), (ex.w2_weight, ref.down_proj)):
        mine = mine.detach().float()
        exact.append(bool(torch.equal(mine, want) or (mine.shape != want.shape
                                                      and torch.equal(mine.transpose(1, 2), want))))
out["exact"] = exact
out["errors"] = {f"{layer}-{tokens}": n015.moe_relative_error(native, hf, layer, n015.moe_input(layer, tokens))
                 for layer in range(4) for tokens in (5, 64)}
st = gptoss_patch.status()
out["mxfp4_patches"] = st.details.get("checkpoint_mxfp4")
out["decision"] = st.decision
from gptoss_patch import evidence
out["evidence"] = sorted(evidence.seen())
print("MX-RESULT " + json.dumps(out))
"""


def _result(proc):
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MX-RESULT ")), None)
    assert line is not None, f"child gave no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[len("MX-RESULT "):])


def test_mxfp4_checkpoint_loads_bit_exact_and_moe_matches_transformers():
    assert ROW.caps["checkpoint_mxfp4"].state == matrix.PATCHED
    res = _result(run_python(CHILD))
    print(f"cell {ROW.vllm_ascend} MXFP4: relative MoE errors {res.get('errors')}")
    assert "config_error" not in res, res
    assert res["decision"] == ROW.verdict and res["quantization"] is None
    assert res["mxfp4_patches"] and all(s.startswith("applied") for s in res["mxfp4_patches"].values()), res
    assert res["exact"] == [True] * 8, res["exact"]
    assert max(res["errors"].values()) <= 1e-4, res["errors"]
    assert "mxfp4" in res["evidence"]


def test_mxfp4_checkpoint_without_gptoss_patch_is_rejected_by_vllm():
    res = _result(run_python(CHILD, GPTOSS_PATCH_DISABLE="1", GPTOSS_PATCH_ALLOW_UNPATCHED="1"))
    print(f"cell {ROW.vllm_ascend} MXFP4 without gptoss-patch: {res}")
    assert "mxfp4" in res.get("config_error", ""), res


def test_every_rank_loads_what_vllms_bf16_loader_loads_from_transformers_dequantization():
    """The per-rank check of the patched cells (tests/cell/test_mxfp4.py), on a natively supporting release."""
    from gptoss_patch.testing.mxfp4_case import check_every_rank

    check_every_rank()
