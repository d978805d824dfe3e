"""Issue 18 in the apply cells (0.11.0, 0.12.0rc1, 0.13.0, 0.14.0rc1): a tiny GPT-OSS in the official MXFP4 layout runs
the main job through vLLM's GptOssForCausalLM and loader on patched vllm-ascend (simulated NPU) with the same greedy
tokens as transformers' run of the same files (experts dequantized by transformers' ``convert_moe_packed_tensors``);
without gptoss-patch vLLM rejects the checkpoint; a truncated shard stops the build before any weight loads, naming
the tensor and its expected shape; ``vllm serve`` of the official layout (``original/`` included) answers with
transformers' tokens; a pair split across shards loads (``mxfp4_cases.py``, shared with the native cells)."""

import json
import os
import subprocess
import sys

import pytest

from mxfp4_cases import test_mxfp4_pair_split_across_shards_with_lm_head_between_loads_as_the_single_file_does  # noqa: F401

from gptoss_patch import matrix

BUILD = """
import sys
from gptoss_patch_testkit import npu_sim
npu_sim.install()
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.jobs.runner import ascend_context
ckpt = write_checkpoint(sys.argv[1], preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
if len(sys.argv) > 2:  # truncate the shard by N bytes (an interrupted download)
    path = ckpt / "model.safetensors"
    os.truncate(path, path.stat().st_size - int(sys.argv[2]))
try:
    with ascend_context(ckpt) as cfg:
        from vllm.model_executor.model_loader import get_model_loader
        get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        print("BUILD-RESULT built")
except Exception as exc:
    print("BUILD-RESULT " + type(exc).__name__ + " " + str(exc).replace(chr(10), " | "))
""".replace("import sys\n", "import os, sys\n", 1)


def _env(**extra):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("GPTOSS_PATCH_ALLOW_UNPATCHED", None)
    env.update(extra)
    return env


def _result(proc, tag):
    for line in proc.stdout.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]
    raise AssertionError(f"no {tag} (rc {proc.returncode}): {proc.stderr[-3000:]}")


@pytest.mark.expensive(28)
def test_main_job_on_an_mxfp4_checkpoint_matches_transformers(layout, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch_testkit.jobs.main_job", "--checkpoint", "mxfp4", "--json",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=1800, env=_env())
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"mxfp4 main job: layout {report['layout']}, seconds {report['seconds']}, max |logit diff| "
          f"{max(c['max_logit_diff'] for c in report['conversations'])}, tokens "
          f"{sum(c['matched'] for c in report['conversations'])}/{sum(c['compared'] for c in report['conversations'])}")
    assert proc.returncode == 0 and report["ok"], report["conversations"]
    assert report["checkpoint"] == "mxfp4" and report["layout"] == layout
    assert len(report["conversations"]) == 5
    for c in report["conversations"]:
        assert c["compared"] == 32 and c["matched"] == c["compared"], c
        assert c["max_logit_diff"] <= report["logit_tolerance"], c
    mx = report["status"]["details"]["checkpoint_mxfp4"]
    assert sorted(mx) == ["checkpoint_mxfp4.dequantize_load", "checkpoint_mxfp4.pairs_across_shards",
                          "checkpoint_mxfp4.unquantized_config"]
    assert all(state.startswith("applied") for state in mx.values()), mx
    assert report["status"]["capabilities"]["checkpoint_mxfp4"]["state"] == matrix.PATCHED
    assert report["evidence"] == ["attention", "moe", "mxfp4"]  # the dequantizing loader and the patched paths ran


def test_mxfp4_checkpoint_without_gptoss_patch_is_rejected_by_vllm(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=900, env=_env(GPTOSS_PATCH_DISABLE="1", GPTOSS_PATCH_ALLOW_UNPATCHED="1"))
    result = _result(proc, "BUILD-RESULT")
    print(f"without gptoss-patch: {result}")
    # vLLM's quantization check on NPU (vllm-ascend's supported_quantization has no mxfp4), or - where vllm-ascend's
    # own quantization config takes over first (measured in the 0.11.0 cell) - the message the issue quotes from
    # vllm_ascend/quantization/utils.py; either way the MXFP4 model does not load
    assert result != "built"
    assert ("mxfp4 quantization is currently not supported in npu" in result
            or "model.layers.0.mlp.experts has different quantization type: set()" in result), result


def test_truncated_mxfp4_shard_stops_the_build_naming_the_tensor(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "ckpt"), "1000"], capture_output=True,
                          text=True, timeout=900, env=_env())
    result = _result(proc, "BUILD-RESULT")
    assert result.startswith("Mxfp4CheckpointError"), result
    assert "truncated shard" in result and "expected shape [" in result, result
    assert "model.layers.3.mlp.router.weight" in result or "_blocks" in result or "_scales" in result, result


def test_every_rank_loads_what_vllms_bf16_loader_loads_from_transformers_dequantization():
    """vLLM's real GptOssModel.load_weights as each rank of TP 2 and TP 4 (intermediate 96: the rank boundaries cut
    MXFP4 blocks) and of EP 2, on the MXFP4 tensors (through our patch) and on transformers' BF16 dequantization of the
    same tensors (vLLM's own BF16 path): the expert parameters are equal bit for bit and nothing is left unset. On vLLM
    0.11.0 EP loads only through ``checkpoint_bf16.ep_expert_range`` (``load_weights`` passes ``(ep_rank_end,
    ep_rank_start)`` to ``_load_weights_other(ep_rank_start, ep_rank_end, ...)``; unpatched, each rank slices
    ``weight[end:start]``, empty: tests/cell/test_serve_more.py shows that failure through ``vllm serve``)."""
    from gptoss_patch_testkit.mxfp4_case import check_every_rank

    check_every_rank()



@pytest.mark.expensive(40)
def test_vllm_serve_official_mxfp4_checkpoint():
    """The tiny model in the official MXFP4 layout, ``original/`` folder included (OpenAI's names and configuration
    beside the Hugging Face files, as the official repositories ship it), through ``vllm serve`` - vLLM's real engine,
    in every patched cell (issue 32: 0.12.0rc1 - 0.14.0rc1 had loaded it only through our runner): the server
    dequantizes the experts while loading and answers with the tokens of transformers' run of the same checkpoint
    (dequantized by transformers' own code); vLLM's loader and our checks read the top-level files only."""
    from pathlib import Path

    from test_serve import WORKDIR, _checks

    from gptoss_patch_testkit.jobs import serve_job

    # eager: the MXFP4 patches act while configuring and loading; this is also the cell's served eager run
    # (tests/cell/test_serve.py serves PIECEWISE and FULL_DECODE_ONLY, and eager only in the 0.11.0 cell)
    report = serve_job.run(WORKDIR, mode="eager", max_tokens=12, checkpoint_format="mxfp4", verify_server=False)
    checkpoint = Path(report.command[4])  # [python, -m, vllm.entrypoints.cli.main, serve, CHECKPOINT, ...]
    assert {p.name for p in (checkpoint / "original").iterdir()} == {"config.json", "dtypes.json", "model.safetensors"}
    _checks(report, "eager")
    assert any(u["capability"] == "mxfp4" for u in report.first_use), report.first_use  # our dequantizing loader ran
