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
* Every native cell, issue 18's main job: ``vllm serve`` of that checkpoint through vLLM's real
  engine (eager, tensor parallel 1) answers every exchange with the greedy tokens and log-probabilities of
  transformers' run of the same MXFP4 files (experts dequantized by ``convert_moe_packed_tensors``, what
  ``Mxfp4Config(dequantize=True)`` runs), the engine core logging our dequantizing loader's first use; on 0.19.1rc1
  (layout I: upstream's attention with GPT-OSS's 128-key band) too.
* A pair split across two shards with ``lm_head.weight`` between its halves loads as from one file
  (``tests/cell/mxfp4_cases.py``, shared with the patched cells).
"""

import json
import os
from pathlib import Path

import pytest
from conftest import ROW, run_python
from mxfp4_cases import test_mxfp4_pair_split_across_shards_with_lm_head_between_loads_as_the_single_file_does  # noqa: F401

from gptoss_patch import matrix
from gptoss_patch_testkit.jobs import serve_job

WORKDIR = Path(os.environ.get("GPTOSS_PATCH_CACHE_DIR", "/tmp/gptoss_patch-cache")) / "main-job"

CHILD = """
import json, sys
import torch
import gptoss_patch
from gptoss_patch.selftest import native as n015
from gptoss_patch.selftest import worker as vllm_setup
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.jobs.runner import _transformers_mxfp4_model
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
    # vLLM's quantization check on NPU (ModelConfig._verify_quantization): the error `vllm serve`'s API server raises
    # from the same EngineArgs.create_engine_config before any engine starts (seen in every native cell)
    assert "mxfp4 quantization is currently not supported in npu" in res.get("config_error", ""), res


def test_every_rank_loads_what_vllms_bf16_loader_loads_from_transformers_dequantization():
    """The per-rank check of the patched cells (tests/cell/test_mxfp4.py), on a natively supporting release."""
    from gptoss_patch_testkit.mxfp4_case import check_every_rank

    check_every_rank()


@pytest.mark.expensive(40)
def test_main_job_on_an_mxfp4_checkpoint_through_the_real_engine_matches_transformers():
    """The main job of the apply cells' MXFP4 case (tests/cell/test_mxfp4.py) through this release's real engine:
    ``vllm serve`` of the tiny GPT-OSS in the official MXFP4 layout (eager, tensor parallel 1: the model runs in
    the engine-core process), asked over HTTP; every exchange's greedy tokens and log-probabilities equal the
    reference's, the engine core's loader took our dequantizing path (first-use line ``mxfp4``) and its first
    forwards our attention path (and, on layout G, our MoE activation path; on layout I upstream's attention, built with
    GPT-OSS's 128-key band), and vLLM configured the model unquantized.

    The reference (``serve_job.run`` -> ``runner.reference_generate`` on the served checkpoint) is transformers'
    float32 ``GptOssForCausalLM`` of the same files: their ``config.json`` names ``quant_method: mxfp4`` and their
    experts exist only as ``*_blocks`` / ``*_scales`` (asserted below), so ``reference_generate`` builds the model
    with ``runner._transformers_mxfp4_model`` - the experts dequantized by transformers' own
    ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``, the conversion ``Mxfp4Config(dequantize=True)``
    applies per expert projection (its ``dequantize``), loaded with ``strict=True``; ``from_pretrained`` with that
    config itself needs ``accelerate``, which the cells do not install.

    Eager: the MXFP4 patches act at configuration and loading only, after which the forward is the BF16 model's,
    served with PIECEWISE graphs at tensor parallel 2 by test_native_serve.py; graphs would add their compilation
    and capture to CI for nothing MXFP4-specific. Without gptoss-patch the same checkpoint stops in
    ``EngineArgs.create_engine_config`` - the call ``vllm serve``'s API server makes before any engine starts -
    with vLLM's "mxfp4 quantization is currently not supported in npu"
    (:func:`test_mxfp4_checkpoint_without_gptoss_patch_is_rejected_by_vllm`).
    """
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=8, startup_timeout=600, checkpoint_format="mxfp4",
                           verify_server=False)  # verify --server: the main job's (test_native_serve.py)
    serve_job.print_report(report)
    assert report.started, report.log_tail
    ckpt = Path(report.command[4])  # [python, -m, vllm.entrypoints.cli.main, serve, CHECKPOINT, ...]
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4", config.get("quantization_config")
    from safetensors import safe_open

    experts = set()
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            experts |= {n for n in f.keys() if ".mlp.experts." in n}
    assert experts == {f"model.layers.{i}.mlp.experts.{w}_{part}" for i in range(4)
                       for w in ("gate_up_proj", "down_proj") for part in ("blocks", "scales", "bias")}, experts
    assert all(p["decision"] == ROW.verdict for p in report.processes), report.processes
    engine = {u["pid"] for u in report.first_use if u["process"].startswith("EngineCore")}
    assert len(engine) == 1 and engine <= {p["pid"] for p in report.processes}, report.first_use
    used = {(u["capability"], u["path"]) for u in report.first_use if u["pid"] in engine}
    assert ("mxfp4", "patched") in used, report.first_use
    assert (("attention", "patched") in used) == (not matrix.native_attention(ROW)), report.first_use
    assert (("moe", "patched") in used) == (ROW.layout == "G"), report.first_use
    # vLLM's engine configuration line: configured unquantized, where unpatched it refuses mxfp4; and the config
    # patch's own line, under vLLM's logger (``vllm.gptoss_patch``) so that every release's server prints it
    log = report.log_text
    assert "quantization=None" in log and "quantization=mxfp4" not in log, report.log_tail
    assert "gptoss-patch: MXFP4 GPT-OSS checkpoint: experts are dequantized to BF16 while loading" in log, \
        report.log_tail
    assert not report.graph_captures, report.graph_captures
    assert len(report.exchanges) == 6 and all(len(e.generated) == 8 for e in report.exchanges)
    for e in report.exchanges:
        assert e.generated == e.reference and e.max_logprob_diff <= serve_job.LOGPROB_TOLERANCE, \
            (e.label, e.generated, e.reference, e.max_logprob_diff)
