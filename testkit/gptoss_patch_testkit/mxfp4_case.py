"""Per-rank MXFP4 loading through vLLM's real GPT-OSS loader, against the same loader fed transformers' BF16.

:func:`compare_ranks` runs the installed vLLM's ``GptOssModel.load_weights`` (wrapped by our ``checkpoint_mxfp4.dequantize_load``
when gptoss-patch is active) as each rank of a tensor- or expert-parallel group, on a one-layer model that holds only
the expert parameters, twice per rank:

* the MXFP4 stream (``w13_weight``/``w13_weight_scale``/``w2_weight``/``w2_weight_scale``: the official tensors after
  vLLM's ``hf_to_vllm_mapper``), config with ``quantization_config.quant_method: mxfp4``;
* the BF16 stream of the same tensors dequantized by transformers' ``integrations/mxfp4.py``
  ``convert_moe_packed_tensors`` (the BF16 checkpoint layout), config without ``quantization_config`` - vLLM's own
  BF16 path, our code not involved.

The rank is what vLLM's module-level rank functions answer (``get_tensor_model_parallel_rank`` / ``_world_size``,
``get_ep_group``, and from vLLM 0.12 ``get_dp_group`` / ``get_pcp_group`` and ``fused_moe/config.py``'s
``get_tensor_model_parallel_rank`` for ``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``): the loader is run,
not a process group. Shapes: experts ``E``, hidden ``H``, intermediate ``I`` with ``I / tp`` cutting
MXFP4 blocks (e.g. ``I = 96``, ``tp = 2``: 48 columns, a block and a half).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _stub_model(gpt_oss_module: Any, E: int, H: int, I: int, per: int, ep: int, mxfp4: bool):
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            local = E // ep
            self.w13_weight = nn.Parameter(torch.full((local, 2 * per, H), float("nan"), dtype=torch.bfloat16),
                                           requires_grad=False)
            self.w2_weight = nn.Parameter(torch.full((local, H, per), float("nan"), dtype=torch.bfloat16),
                                          requires_grad=False)

    class OneLayer(gpt_oss_module.GptOssModel):  # vLLM's methods; of GptOssModel's state what load_weights reads
        def __init__(self):
            nn.Module.__init__(self)
            self.layers = nn.ModuleList([nn.Module()])
            self.layers[0].mlp = nn.Module()
            self.layers[0].mlp.experts = Experts()
            cfg = dict(model_type="gpt_oss", num_local_experts=E, hidden_size=H, intermediate_size=I,
                       num_attention_heads=8, num_hidden_layers=1)
            if mxfp4:
                cfg["quantization_config"] = {"quant_method": "mxfp4"}
            self.config = types.SimpleNamespace(**cfg)
            self.parallel_config = types.SimpleNamespace(enable_expert_parallel=ep > 1)

    return OneLayer


def _moe_config_module() -> Any:
    """vLLM's ``fused_moe/config.py``: from vLLM 0.12 ``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp`` asks
    its own module-level ``get_tensor_model_parallel_rank`` (None where the module has no such name)."""
    import importlib

    try:
        mod = importlib.import_module("vllm.model_executor.layers.fused_moe.config")
    except ImportError:
        return None
    return mod if hasattr(mod, "get_tensor_model_parallel_rank") else None


def set_rank(g: Any, tp: int, tp_rank: int, ep: int, ep_rank: int) -> None:
    """Make vLLM's module-level rank functions that ``GptOssModel.load_weights`` reaches (module ``g`` =
    ``vllm.model_executor.models.gpt_oss``, and ``fused_moe/config.py`` from vLLM 0.12) answer as rank ``tp_rank`` of
    ``tp`` and ``ep_rank`` of ``ep`` (DP and PCP of size 1). The caller restores them (:func:`compare_ranks` does)."""
    moe_config = _moe_config_module()
    if moe_config is not None:
        moe_config.get_tensor_model_parallel_rank = lambda: tp_rank
    g.get_tensor_model_parallel_rank = lambda: tp_rank
    g.get_tensor_model_parallel_world_size = lambda: tp
    g.get_ep_group = lambda: types.SimpleNamespace(world_size=ep, rank=ep_rank, rank_in_group=ep_rank)
    if hasattr(g, "get_dp_group"):
        g.get_dp_group = lambda: types.SimpleNamespace(world_size=1, rank=0, rank_in_group=0)
    if hasattr(g, "get_pcp_group"):
        g.get_pcp_group = lambda: types.SimpleNamespace(world_size=1, rank=0, rank_in_group=0)


def compare_ranks(E: int = 4, H: int = 64, I: int = 96, tp: int = 2, ep: int = 1, seed: int = 0) -> list[dict]:
    """Load one layer as every rank of ``tp`` (or of ``ep`` with expert parallelism), MXFP4 vs transformers' BF16.

    Returns:
        Per rank ``{"rank", "equal", "mxfp4_error", "bf16_error", "nan_left"}``: ``equal`` is True when both loads
        succeeded and the expert parameters are equal bit for bit; ``*_error`` the exception (type and message) a load
        raised (vLLM's own BF16 path included); ``nan_left`` True when the MXFP4 load left a parameter element unset.

    Raises:
        ImportError: vLLM is not installed.
    """
    import vllm.model_executor.models.gpt_oss as g
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gptoss_patch.kernels.mxfp4 import expected_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for kind, vname in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
        shapes = expected_shapes(kind, E, H, I)
        tensors[vname] = torch.randint(0, 256, shapes["blocks"], generator=gen, dtype=torch.uint8)
        tensors[vname + "_scale"] = torch.randint(118, 137, shapes["scales"], generator=gen, dtype=torch.uint8)
    bf16 = {v: convert_moe_packed_tensors(tensors[v].clone(), tensors[v + "_scale"].clone())
            for v in ("w13_weight", "w2_weight")}
    prefix = "layers.0.mlp.experts."
    saved = {k: getattr(g, k) for k in ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                                        "get_ep_group", "get_dp_group", "get_pcp_group") if hasattr(g, k)}
    moe_config = _moe_config_module()
    saved_moe = moe_config.get_tensor_model_parallel_rank if moe_config is not None else None
    results = []
    try:
        for rank in range(max(tp, ep)):
            per = -(-I // tp) if ep == 1 else I
            set_rank(g, tp if ep == 1 else 1, rank if ep == 1 else 0, ep, rank if ep > 1 else 0)
            out = {"rank": rank}
            params = {}
            for label, mx, stream in (
                    ("mxfp4", True, [(prefix + k, tensors[k]) for k in ("w2_weight", "w2_weight_scale",
                                                                          "w13_weight_scale", "w13_weight")]),
                    ("bf16", False, [(prefix + k, bf16[k]) for k in ("w13_weight", "w2_weight")])):
                model = _stub_model(g, E, H, I, per, ep, mx)()
                try:
                    model.load_weights(iter(stream))
                    params[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
                    out[f"{label}_error"] = None
                except Exception as exc:  # noqa: BLE001 - reported to the test, which compares both paths
                    out[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if "mxfp4" in params and "bf16" in params:
                out["equal"] = all(torch.equal(params["mxfp4"][n].view(torch.int16), params["bf16"][n].view(torch.int16))
                                   for n in params["bf16"])
                out["nan_left"] = any(bool(p.isnan().any()) for p in params["mxfp4"].values())
            else:
                out["equal"], out["nan_left"] = False, None
            results.append(out)
    finally:
        for k, v in saved.items():
            setattr(g, k, v)
        if moe_config is not None:
            moe_config.get_tensor_model_parallel_rank = saved_moe
    return results


_RANKS = """
import json
from gptoss_patch_testkit import npu_sim
npu_sim.install()
import vllm_ascend  # noqa: F401 - activation through the import hook, as in an NPU worker
from gptoss_patch_testkit.mxfp4_case import compare_ranks
print("RANKS-RESULT " + json.dumps({f"tp{tp}-ep{ep}": compare_ranks(tp=tp, ep=ep) for tp, ep in ((2, 1), (4, 1), (1, 2))}))
"""


def check_every_rank() -> dict:
    """Run :func:`compare_ranks` for TP 2, TP 4 and EP 2 in a child interpreter (a fresh distributed world) and assert
    what the cell tests require: every TP and EP rank's experts equal vLLM's BF16 load bit for bit with nothing left
    unset (on vLLM 0.11.0, whose BF16 loader passes the EP range swapped, through
    :mod:`gptoss_patch.patches.checkpoint_bf16`). Returns the child's results.

    Raises:
        AssertionError: the child gave no result, or a rank differs.
    """
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _RANKS], capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RANKS-RESULT ")), None)
    assert line is not None, f"child gave no result (rc {proc.returncode}): {proc.stderr[-3000:]}"
    res = json.loads(line[len("RANKS-RESULT "):])
    print(f"per-rank MXFP4 vs BF16 loads: { {k: [r['equal'] or r['bf16_error'] for r in v] for k, v in res.items()} }")
    for case, ranks in (("tp2-ep1", 2), ("tp4-ep1", 4), ("tp1-ep2", 2)):
        assert [r["bf16_error"] is None and r["equal"] and not r["nan_left"] for r in res[case]] == [True] * ranks, \
            res[case]
    return res
