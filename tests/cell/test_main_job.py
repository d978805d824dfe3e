"""Issue 7 in a real cell: harmony prompts through vLLM's GptOssForCausalLM on patched vllm-ascend (simulated NPU)
give the same greedy tokens as transformers, eager and with FULL_DECODE_ONLY ACL graphs; the KV-cache groups are the
release's (0.14.0rc1: a sliding-window group whose out-of-window blocks are never read); with the patches off or one
patch failing, the guard stops the load."""

import json
import re
import subprocess
import sys

import pytest

from gptoss_patch import matrix
from gptoss_patch_testkit.jobs import main_job

BUILD_MODEL = """
import os, sys
from gptoss_patch_testkit import npu_sim
npu_sim.install()
{prelude}
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.jobs.runner import ascend_context
ckpt = write_checkpoint(sys.argv[1], preset="tiny", seed=0, tokenizer=False)
with ascend_context(ckpt) as cfg:
    from vllm.model_executor.model_loader import get_model_loader
    try:
        get_model_loader(cfg.load_config).load_model(vllm_config=cfg, model_config=cfg.model_config)
        print("GUARD-RESULT built")
    except Exception as exc:
        print("GUARD-RESULT " + type(exc).__name__ + " " + str(exc).replace(chr(10), " | "))
"""

#: Two requests of random token ids (longer than two 128-token blocks, so the sliding window of 128 leaves whole
#: blocks behind), a few greedy steps, against transformers; then the same with the out-of-window entries of the
#: *full-attention* group pointed at the null block too (a negative control: those layers do need them).
WINDOW_RUN = """
import json, sys
import torch
from gptoss_patch_testkit import npu_sim
npu_sim.install()
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.jobs.runner import NULL_BLOCK, SimulatedGptOss, ascend_context, reference_generate
ckpt = write_checkpoint(sys.argv[1], preset="tiny", seed=0, tokenizer=False)
gen = torch.Generator().manual_seed(7)
prompts = [torch.randint(0, 200000, (n,), generator=gen).tolist() for n in (300, 281)]
steps = 6
ref = reference_generate(ckpt, prompts, steps)


class AlsoFullGroup(SimulatedGptOss):
    also_full = False

    def _table_row(self, group, req, gi):
        row = super()._table_row(group, req, gi)
        if self.also_full and not group.sliding_window:
            window = next(g.sliding_window for g in self.groups if g.sliding_window)
            skipped = max(0, req.computed - window + 1) // self.block_size
            for i in range(min(skipped, len(row))):
                row[i] = NULL_BLOCK
                self.nulled_entries += 1
        return row


out = {}
with ascend_context(ckpt, dtype="float32") as cfg:
    sim = AlsoFullGroup(cfg, num_blocks=40)  # null_out_of_window: as vLLM does for the release
    out["layout"] = sim.layout
    out["groups"] = sim.kv_groups_summary()
    if not any(g["sliding_window"] for g in out["groups"]):
        try:
            sim.resolve_null_out_of_window(True)
            out["explicit_null_error"] = None
        except ValueError as exc:
            out["explicit_null_error"] = str(exc)
    else:
        for label, also_full in (("window_only", False), ("also_full", True)):
            sim.also_full = also_full
            sim.nulled_entries = 0
            reqs = sim.generate(prompts, steps, forced=[t for t, _ in ref])
            out[label] = {
                "nulled": sim.nulled_entries,
                "matched": sum(int(a == b) for r, (t, _) in zip(reqs, ref) for a, b in zip(r.output, t)),
                "compared": sum(len(t) for t, _ in ref),
                "max_logit_diff": max(float((a - b).abs().max()) for r, (_, lg) in zip(reqs, ref)
                                      for a, b in zip(r.logits, lg)),
            }
print("WINDOW-RESULT " + json.dumps(out))
"""


def _result(proc, tag):
    for line in proc.stdout.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]
    raise AssertionError(f"no {tag} (rc {proc.returncode}): {proc.stderr[-3000:]}")


def test_verify_simulate_runs_the_main_job_and_every_token_matches(layout, verify_simulate):
    proc, report = verify_simulate  # conftest: one testkit verify --json run, shared with test_activation
    for mode, job in report.get("main_job", {}).items():  # the measured numbers (shown by pytest -rA)
        print(f"{mode}: layout {job.get('layout')}, seconds {job.get('seconds')}, graph replays "
              f"{job.get('graph_steps')} (sizes {job.get('captured_sizes')}), max |logit diff| "
              f"{max((c['max_logit_diff'] for c in job.get('conversations', [])), default=None)}, tokens "
              f"{sum(c['matched'] for c in job.get('conversations', []))}/"
              f"{sum(c['compared'] for c in job.get('conversations', []))}, null-block entries "
              f"{job.get('nulled_block_entries')}, environment {job.get('environment')}")
    assert proc.returncode == 0, report["problems"]
    needed = set(matrix.LAYOUT_PATCHES[layout])
    for mode in ("eager", "graph"):
        job = report["main_job"][mode]
        assert job["ok"] and len(job["conversations"]) >= 4, mode
        assert job["layout"] == layout
        for c in job["conversations"]:
            assert 200 <= c["prompt_tokens"] <= 400
            assert c["compared"] >= 32 and c["matched"] == c["compared"], (mode, c)
            assert c["max_logit_diff"] <= job["logit_tolerance"], (mode, c)
        assert {"PrefillNoCache", "ChunkedPrefill", "DecodeOnly"} <= set(job["states_seen"])
        assert job["reused_prefix_blocks"] >= 1
        applied = {p["name"] for p in job["status"]["patches"] if p["state"] == "applied"}
        assert needed <= applied, needed - applied
        assert job["evidence"] == ["attention", "moe"], job["evidence"]  # the patched paths really ran
        assert _windowed(job["kv_groups"]) == (layout == "F"), job["kv_groups"]
        nz_off = layout in main_job.FLOAT32_NZ_OFF_LAYOUTS  # float32 cannot be FRACTAL_NZ: see there
        assert job["environment"] == ({"VLLM_ASCEND_ENABLE_NZ": "0"} if nz_off else {}), job["environment"]
        # worker patches left out (they need torchvision) patch vision-language models only
        assert all(re.search(r"patch_qwen[\d_]*(vl|omni)\b", s) for s in job["worker_patches_skipped"]), job
        if layout == "F":  # vLLM's sliding-window manager frees blocks that left the window: every run meets some
            assert job["nulled_block_entries"] > 0
    assert report["main_job"]["eager"]["graph_steps"] == 0
    graph = report["main_job"]["graph"]
    assert graph["graph_steps"] >= 16  # pure decode steps replayed from captured graphs
    assert graph["captured_sizes"] and max(graph["captured_sizes"]) <= len(graph["conversations"])


def _windowed(groups):
    return any(g["sliding_window"] for g in groups)


def test_kv_cache_groups_of_the_release_and_the_sliding_window_null_block(tmp_path, layout):
    """Up to 0.13.0 the runner gives every layer a FullAttentionSpec: one group. 0.14.0rc1 asks the layers, so the
    sliding-window layers form their own group; vLLM then points their out-of-window blocks at the null block. With
    the null block full of large random values, the tokens still match transformers (the window is honoured), while
    doing the same to the full-attention group breaks the logits (the null block really is read when attended)."""
    proc = subprocess.run([sys.executable, "-c", WINDOW_RUN, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=1500)
    out = json.loads(_result(proc, "WINDOW-RESULT"))
    assert out["layout"] == layout
    groups = out["groups"]
    layers = [f"model.layers.{i}.attn.attn" for i in range(4)]
    if layout != "F":
        assert groups == [{"spec": "FullAttentionSpec", "sliding_window": None, "layers": layers}]
        assert "needs a sliding-window KV-cache group" in out["explicit_null_error"]
        return
    assert groups == [{"spec": "SlidingWindowSpec", "sliding_window": 128, "layers": layers[0::2]},
                      {"spec": "FullAttentionSpec", "sliding_window": None, "layers": layers[1::2]}]
    ok, control = out["window_only"], out["also_full"]
    assert ok["nulled"] > 0 and ok["matched"] == ok["compared"] == 12, ok
    assert ok["max_logit_diff"] <= 1e-3, ok
    assert control["nulled"] > ok["nulled"] and control["max_logit_diff"] > 0.5, control


def test_guard_stops_a_gpt_oss_load_with_patches_disabled(tmp_path):
    proc = subprocess.run([sys.executable, "-c", BUILD_MODEL.format(prelude=""), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=900, env=_env(GPTOSS_PATCH_DISABLE="1"))
    result = _result(proc, "GUARD-RESULT")
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
    result = _result(proc, "GUARD-RESULT")
    assert result.startswith("GptOssNotPatchedError")
    assert "not applied: yarn.truncate" in result and "structural check failed" in result
    assert "attention.keep_sinks" not in result  # the applied ones are not listed


def _env(**extra):
    import os

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("GPTOSS_PATCH_ALLOW_UNPATCHED", None)
    env.update(extra)
    return env


def test_runner_rules_are_what_the_installed_model_runner_does(layout):
    """Issue 32: the runner job's per-release rules (``runner.RUNNER_RULES``, restated from vllm-ascend's
    ``NPUModelRunner``) checked against this cell's installed ``worker/model_runner_v1.py`` (read with :mod:`ast`, not
    imported): where the attention mask comes from, which KV-cache spec decoder layers get, which FULL-graph update
    the runner calls after a replay and with what, and whether it refreshes the rope's cos/sin per step. The served
    main job (test_serve.py) runs the real runner; this keeps the runner job's restatement of it honest."""
    import ast
    import importlib.util
    from pathlib import Path

    from gptoss_patch_testkit.jobs.runner import RUNNER_RULES

    rules = RUNNER_RULES[layout]
    root = Path(importlib.util.find_spec("vllm_ascend").submodule_search_locations[0])
    src = (root / "worker" / "model_runner_v1.py").read_text()
    tree = ast.parse(src)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    metadata = next(n for n in ast.walk(ast.parse((root / "attention" / "utils.py").read_text()))
                    if isinstance(n, ast.ClassDef) and n.name == "AscendCommonAttentionMetadata")
    fields = {n.target.id for n in metadata.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    # the mask: the runner's _make_attention_mask into AscendCommonAttentionMetadata.attn_mask, or the builder's own
    if rules.mask == "builder":
        assert "attn_mask" not in fields and "_make_attention_mask" not in functions, layout
    else:
        assert "attn_mask" in fields and "_make_attention_mask" in functions, layout
        body = ast.get_source_segment(src, functions["_make_attention_mask"])
        last = functions["_make_attention_mask"].body[-1]
        per_state = "AscendAttentionState.PrefillNoCache" in body
        always_splitfuse = isinstance(last, ast.Return) and "get_splitfuse_attn_mask()" in ast.unparse(last)
        assert (per_state, always_splitfuse) == ((True, False) if rules.mask == "per-state" else (False, True)), body

    # the KV-cache spec: FullAttentionSpec for every decoder layer, or the layer's own get_kv_cache_spec
    spec = ast.get_source_segment(src, functions["get_kv_cache_spec"])
    assert ("attn_module.get_kv_cache_spec(" in spec) == (rules.kv_spec == "layer"), spec

    # the FULL-graph update after a replay, and its arguments
    name = rules.graph_update.split("+")[0]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]
    assert calls, f"{name} is not called by the installed model runner"
    other = "update_full_graph_params" if name == "update_attn_params" else "update_attn_params"
    assert f"{other}(" not in src, other
    if name == "update_attn_params":
        with_config = {any(ast.unparse(a) == "self.vllm_config" for a in c.args) for c in calls}
        assert with_config == {rules.graph_update.endswith("+config")}, [ast.unparse(c) for c in calls]

    # the rope's cos/sin refreshed per step
    assert ("update_cos_sin(" in src) == rules.update_cos_sin
