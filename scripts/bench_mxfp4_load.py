"""Peak host memory of loading one gpt-oss-120b layer's MXFP4 experts as one TP-8 rank, through vLLM's BF16 loader.

Run in a cell venv (vLLM's real ``GptOssModel.load_weights`` / ``_load_weights_other`` and its safetensors iterator):

    ~/.cache/gptoss-patch/venvs/cell-0.11.0-*/bin/python scripts/bench_mxfp4_load.py [--rank 3] [--dir DIR]

1. Writes (once, in a child process) one layer of the official MXFP4 layout at gpt-oss-120b's geometry (E 128, H 2880,
   I 2880): ``gate_up_proj_blocks [128, 5760, 90, 16]`` + scales, ``down_proj_blocks [128, 2880, 90, 16]`` + scales
   (1.69 GB), random codes and scales 118..136.
2. In a fresh child: allocates the rank's BF16 expert parameters (``w13_weight [128, 720, 2880]``, ``w2_weight
   [128, 2880, 360]``, 0.80 GB - on an NPU they are device memory), records its RSS, then streams the file through
   vLLM's ``safetensors_weights_iterator`` (mmap, lazy) into vLLM's ``GptOssModel.load_weights`` wrapped by our
   ``checkpoint_mxfp4.dequantize_load`` (as rank ``--rank`` of TP 8: vLLM's module-level rank functions answer for that rank; a
   one-layer stand-in module holds the parameters). Peak RSS (``VmHWM``, file-backed mmap pages included) minus the RSS
   before loading is what loading cost on the host.

Printed, not asserted; the goal (issue 18) is a host peak within 2x the rank's BF16 expert bytes of the layer. For
comparison it prints the bytes a whole-layer BF16 dequantization would need (what dequantizing before vLLM's per-rank
slicing costs: 6.4 GB for this layer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

E, H, I, TP = 128, 2880, 2880, 8

WRITE = """
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
E, H, I = %d, %d, %d
base = "model.layers.0.mlp.experts."
t = {}
for kind, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
    t[base + kind + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    t[base + kind + "_scales"] = torch.randint(118, 137, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
save_file(t, sys.argv[1], metadata={"format": "pt"})
""" % (E, H, I)

LOAD = """
import json, sys, time, types
import torch
from torch import nn

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

rank, tp, path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[1]
E, H, I = %d, %d, %d
import vllm.model_executor.models.gpt_oss as g
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from gptoss_patch.patches import checkpoint_mxfp4 as mxfp4
# vLLM's own rank answers, as on rank `rank` of TP `tp` (no process group needed for a loader-only run)
from gptoss_patch_testkit.mxfp4_case import set_rank
set_rank(g, tp, rank, 1, 0)

per = I // tp
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(E, 2 * per, H, dtype=torch.bfloat16), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(E, H, per, dtype=torch.bfloat16), requires_grad=False)
class Stub(g.GptOssModel):  # vLLM's GptOssModel methods; of its state only what load_weights reads, one layer
    def __init__(self):
        nn.Module.__init__(self)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = nn.Module()
        self.layers[0].mlp.experts = Experts()
        self.config = types.SimpleNamespace(model_type="gpt_oss", num_local_experts=E, hidden_size=H,
                                            intermediate_size=I, num_attention_heads=64, num_hidden_layers=1,
                                            quantization_config={"quant_method": "mxfp4"})
        self.parallel_config = types.SimpleNamespace(enable_expert_parallel=False)
model = Stub()
params = sum(p.numel() * p.element_size() for p in model.parameters())
before = rss("VmRSS")
mapper = {"gate_up_proj_blocks": "w13_weight", "gate_up_proj_scales": "w13_weight_scale",
          "down_proj_blocks": "w2_weight", "down_proj_scales": "w2_weight_scale"}
def weights():  # GptOssForCausalLM.hf_to_vllm_mapper + AutoWeightsLoader's "model." prefix strip
    for name, t in safetensors_weights_iterator([path], False):
        head, _, tail = name.rpartition(".")
        yield head.replace("model.", "", 1) + "." + mapper[tail], t
t0 = time.perf_counter()
orig = g.GptOssModel.load_weights
loaded = mxfp4._load_weights(lambda w: orig(model, w), model, (weights(),), {})
seconds = time.perf_counter() - t0
peak = rss("VmHWM")
# the loaded slice, against transformers' dequantization of the same rank slice (spot check: first 2 experts)
from safetensors import safe_open
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
s, e = rank * per, (rank + 1) * per
with safe_open(path, "pt") as f:
    gu = convert_moe_packed_tensors(f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks")[:2],
                                    f.get_slice("model.layers.0.mlp.experts.gate_up_proj_scales")[:2])
    dn = convert_moe_packed_tensors(f.get_slice("model.layers.0.mlp.experts.down_proj_blocks")[:2],
                                    f.get_slice("model.layers.0.mlp.experts.down_proj_scales")[:2])
ex = model.layers[0].mlp.experts
exact = (torch.equal(ex.w13_weight[:2].view(torch.int16), gu[:, :, 2 * s:2 * e].permute(0, 2, 1).contiguous().view(torch.int16))
         and torch.equal(ex.w2_weight[:2].view(torch.int16), dn[:, s:e, :].permute(0, 2, 1).contiguous().view(torch.int16)))
print("RESULT " + json.dumps({"params": params, "rss_before": before, "peak": peak, "seconds": seconds,
                              "loaded": sorted(loaded), "exact": exact}))
""" % (E, H, I)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=3, help="TP rank (of 8) to load as (default 3)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "gptoss-mxfp4-bench"))
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "layer0-mxfp4.safetensors")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", WRITE, path + ".tmp"], check=True)
        os.replace(path + ".tmp", path)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")  # importing vLLM's gpt_oss resolves the platform: vllm-ascend
    proc = subprocess.run([sys.executable, "-c", LOAD, path, str(args.rank), str(TP)], capture_output=True, text=True,
                          env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(proc.stderr[-3000:])
        return 1
    r = json.loads(line[len("RESULT "):])
    rank_bf16 = r["params"]
    transient = r["peak"] - r["rss_before"]
    full_layer = 2 * E * (H * 2 * I + I * H)
    print(f"gpt-oss-120b layer experts (E {E}, H {H}, I {I}) in MXFP4: {os.path.getsize(path) / 1e9:.2f} GB file; "
          f"TP-{TP} rank {args.rank}")
    print(f"  rank's BF16 expert bytes (w13 + w2 parameters): {rank_bf16 / 1e9:.3f} GB; whole layer in BF16: "
          f"{full_layer / 1e9:.2f} GB")
    print(f"  host peak while loading, above the parameters: {transient / 1e9:.3f} GB "
          f"({transient / rank_bf16:.2f}x the rank's BF16 expert bytes; goal <= 2x)")
    print(f"  process peak RSS {r['peak'] / 1e9:.3f} GB (RSS before loading {r['rss_before'] / 1e9:.3f} GB, parameters "
          f"included: on an NPU they are device memory), load time {r['seconds']:.1f} s")
    print(f"  loaded {r['loaded']}; rank slice equals transformers' dequantization (experts 0-1): {r['exact']}")
    return 0 if r["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
