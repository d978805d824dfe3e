"""MXFP4 cases shared by the patched cells (test_mxfp4.py) and the native ones (native_015/test_native_mxfp4.py):
imported by name into each, so that each cell runs them with its own vLLM."""

import json
import os
import subprocess
import sys

SPLIT = """
import copy, glob, json, os, shutil, sys
from pathlib import Path
from gptoss_patch_testkit import npu_sim
npu_sim.install()
from safetensors.torch import load_file, save_file
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.jobs.runner import ascend_context
root = Path(sys.argv[1])
whole = write_checkpoint(root / "whole", preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
split = Path(shutil.copytree(whole, root / "split"))
tensors = load_file(str(split / "model.safetensors"))
(split / "model.safetensors").unlink()
names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
for n in names:
    (split / n).touch()
# vLLM <= 0.15 reads the shards in glob order, 0.16+ sorted by weight_utils._natural_sort_key: the shard read
# last holds lm_head.weight and layer 1's down_proj_scales, the one read first everything else - safetensors lists
# a shard's names sorted, so the stream is model.* (with layer 1's down_proj_blocks), lm_head.weight, the scales
from vllm.model_executor.model_loader import weight_utils
order = [os.path.basename(p) for p in glob.glob(str(split / "*.safetensors"))]
if hasattr(weight_utils, "_natural_sort_key"):
    order = sorted(order, key=weight_utils._natural_sort_key)
late = {"lm_head.weight", "model.layers.1.mlp.experts.down_proj_scales"}
shards = {order[0]: {k: v for k, v in tensors.items() if k not in late},
          order[1]: {k: v for k, v in tensors.items() if k in late}}
for n, part in shards.items():
    save_file(part, str(split / n), metadata={"format": "pt"})
(split / "model.safetensors.index.json").write_text(json.dumps(
    {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}))
out = {}
try:
    with ascend_context(split) as cfg:
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.models import gpt_oss
        calls = []
        inner = gpt_oss.GptOssModel.load_weights
        def counted(self, weights):
            names = []
            def seen():
                for name, t in weights:
                    names.append(name)
                    yield name, t
            calls.append(names)
            return inner(self, seen())
        gpt_oss.GptOssModel.load_weights = counted
        loader = get_model_loader(cfg.load_config)
        model = loader.load_model(vllm_config=cfg, model_config=cfg.model_config)
        out["calls"] = [[n for n in c if "layers.1.mlp.experts.w2_weight" in n] for c in calls]
        split_params = {k: v.detach().clone() for k, v in model.named_parameters()}
        gpt_oss.GptOssModel.load_weights = inner
        whole_config = copy.copy(cfg.model_config)
        whole_config.model = str(whole)
        cfg.compilation_config.static_forward_context.clear()  # a second model's layers register the same names
        reference = loader.load_model(vllm_config=cfg, model_config=whole_config)
        whole_params = dict(reference.named_parameters())
        out["differ"] = sorted(k for k, v in split_params.items() if not v.equal(whole_params[k].detach()))
        out["compared"] = len(split_params)
        out["built"] = True
except Exception as exc:
    out["error"] = type(exc).__name__ + " " + str(exc).replace(chr(10), " | ")[:1500]
print("SPLIT-RESULT " + json.dumps(out))
"""


def test_mxfp4_pair_split_across_shards_with_lm_head_between_loads_as_the_single_file_does(tmp_path):
    """A complete official-layout checkpoint whose shard boundary falls between layer 1's ``down_proj_blocks`` and
    ``down_proj_scales``, with ``lm_head.weight`` sorted between them in the load stream: vLLM's ``AutoWeightsLoader``
    hands ``GptOssModel.load_weights`` the pair's halves in two calls (asserted: the blocks in one, the scales in a
    later one), and every parameter loads equal, bit for bit, to a load of the same tensors from one file (issue 32:
    refused before, "``down_proj_blocks`` has no ``down_proj_scales``")."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("GPTOSS_PATCH_ALLOW_UNPATCHED", None)
    proc = subprocess.run([sys.executable, "-c", SPLIT, str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SPLIT-RESULT ")), None)
    assert line is not None, f"no result (rc {proc.returncode}): {proc.stderr[-3000:]}"
    res = json.loads(line[len("SPLIT-RESULT "):])
    print(f"MXFP4 pair split across shards: {res}")
    assert res.get("built"), res
    calls = [c for c in res["calls"] if c]
    # GptOssModel sees the names under AutoWeightsLoader's prefix ("model.") stripped
    assert calls == [["layers.1.mlp.experts.w2_weight"], ["layers.1.mlp.experts.w2_weight_scale"]], res["calls"]
    assert res["compared"] > 20 and res["differ"] == [], res
