"""Issue 7 in a real cell: harmony prompts through vLLM's GptOssForCausalLM on patched vllm-ascend (simulated NPU)
give the same greedy tokens as transformers; with the patches off or one patch failing, the guard stops the load."""

import json
import subprocess
import sys

BUILD_MODEL = """
import os, sys
from gptoss_patch.testing import npu_sim
npu_sim.install()
{prelude}
from gptoss_patch.testing.tiny import write_checkpoint
from gptoss_patch.testing.runner import ascend_context
ckpt = write_checkpoint(sys.argv[1], preset="tiny", seed=0, tokenizer=False)
with ascend_context(ckpt) as cfg:
    from vllm.model_executor.model_loader import get_model_loader
    try:
        get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        print("GUARD-RESULT built")
    except Exception as exc:
        print("GUARD-RESULT " + type(exc).__name__ + " " + str(exc).replace(chr(10), " | "))
"""


def _guard_result(proc):
    for line in proc.stdout.splitlines():
        if line.startswith("GUARD-RESULT "):
            return line[len("GUARD-RESULT "):]
    raise AssertionError(f"no result (rc {proc.returncode}): {proc.stderr[-3000:]}")


def test_verify_simulate_runs_the_main_job_and_every_token_matches():
    proc = subprocess.run([sys.executable, "-m", "gptoss_patch.verify", "--simulate", "--json"], capture_output=True,
                          text=True, timeout=2400)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, report["problems"]
    for mode in ("eager", "graph"):
        job = report["main_job"][mode]
        assert job["ok"] and len(job["conversations"]) >= 4, mode
        for c in job["conversations"]:
            assert 200 <= c["prompt_tokens"] <= 400
            assert c["compared"] >= 32 and c["matched"] == c["compared"], (mode, c)
            assert c["max_logit_diff"] <= job["logit_tolerance"], (mode, c)
        assert {"PrefillNoCache", "ChunkedPrefill", "DecodeOnly"} <= set(job["states_seen"])
        assert job["reused_prefix_blocks"] >= 1
        applied = {p["name"] for p in job["status"]["patches"] if p["state"] == "applied"}
        assert {"attention.keep_sinks", "attention.sink_window_forward", "rope.yarn_truncate", "moe.apply_mlp",
                "aclgraph.update_attn_params"} <= applied, applied
    assert report["main_job"]["eager"]["graph_steps"] == 0
    assert report["main_job"]["graph"]["graph_steps"] >= 16  # pure decode steps replayed from captured graphs


def test_guard_stops_a_gpt_oss_load_with_patches_disabled(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BUILD_MODEL.format(prelude=""), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=900, env=_env(GPTOSS_PATCH_DISABLE="1"))
    result = _guard_result(proc)
    assert result.startswith("GptOssNotPatchedError")
    assert "decision: disabled" in result and "every GPT-OSS patch" in result
    assert "attention sinks" in result and "swigluoai" in result


def test_guard_names_the_patch_that_failed(tmp_path):
    # Make one target structurally incompatible before our post-import hook sees it (hooks run in
    # registration order): the rope patch then fails its structural check, and the load must stop.
    prelude = (
        "import wrapt\n"
        "def sabotage(mod):\n"
        "    orig = mod.AscendYaRNRotaryEmbedding.__init__\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        orig(self, *args, **kwargs)\n"
        "    mod.AscendYaRNRotaryEmbedding.__init__ = __init__\n"
        "wrapt.register_post_import_hook(sabotage, 'vllm_ascend.ops.rotary_embedding')\n")
    proc = subprocess.run([sys.executable, "-c", BUILD_MODEL.format(prelude=prelude), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=900, env=_env())
    result = _guard_result(proc)
    assert result.startswith("GptOssNotPatchedError")
    assert "not applied: rope.yarn_truncate" in result and "structural check failed" in result
    assert "attention.keep_sinks" not in result  # the applied ones are not listed


def _env(**extra):
    import os

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(extra)
    return env
