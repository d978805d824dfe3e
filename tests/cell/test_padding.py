"""Issue 5 in a real cell: GPT-OSS MoE weights padded to the FRACTAL_NZ alignment, through vllm-ascend's own code.

Layers are built as vLLM builds them (``FusedMoE(...)`` with ``MLPBlock``'s arguments -> vllm-ascend's
``AscendFusedMoE``), filled the way vLLM 0.11.0's BF16 loader fills them (``param.copy_`` of each rank's slice), then
processed by the *patched* ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` (our padding, then
upstream's transpose and NZ cast) and run through the patched apply path (``gptoss_patch.patches.moe``) and the
simulator's ``npu_grouped_matmul``, which enforces the NZ rule (``k % 16``, ``n % 16`` for bf16).

Every apply cell runs this file against its own wheel's NZ decision (``gptoss_patch.matrix.NZ_RULES``,
checked against the wheel by :func:`test_installed_wheel_nz_rule`):

* 0.11.0 decides with ``is_enable_nz(dtype)``: ``_ENABLE_NZ = VLLM_ASCEND_ENABLE_NZ`` (and not qwen3_next), and for
  fp16/bf16/fp32 it returns ``_ENABLE_NZ`` only when ``_IS_EAGLE_MODE`` (speculative method eagle/eagle3), else False;
* 0.12.0rc1 with ``is_enable_nz()`` = ``VLLM_ASCEND_ENABLE_NZ`` (default 1), for every dtype: NZ by default;
* 0.13.0 and 0.14.0rc1 with ``maybe_trans_nz(weight)``: bf16/fp16 only with ``VLLM_ASCEND_ENABLE_NZ=2``, fp32 never.

:func:`nz_switch` sets the variable (mode 0, 1, 2) and, on 0.11.x, that eagle flag - the very globals upstream reads -
so the wheel's own ``process_weights_after_loading`` casts (or not); the padding must engage exactly where it casts.

Exactness. The padded model computes the same sums plus ``+0`` terms. Whether the *float32 bits* agree depends on the
accumulation order: the device's cube walks K in 16-wide fractals with zero-filled tails, so K = 360 and K = 368 add
the same products in the same order. The simulator's grouped matmul is CPU BLAS (MKL), whose default kernels block K
differently for 360 and 368 (measured: ``x @ w`` vs ``pad(x) @ pad(w)`` at (256, 360) x (360, 2880), standard normal
inputs: 72 % of the outputs differ, by up to 3.4e-5 on values up to ~100, a few float32 ulps; through the whole MoE
layer 1.3e-5 in float32 and one bf16 ulp in bfloat16). :func:`test_padding_is_bit_exact_in_float32` therefore
runs the comparison in a child interpreter with ``MKL_CBWR=COMPATIBLE`` (MKL's sequential reproducible code path, where
that control product agrees bit for bit) and requires ``torch.equal``; in this process the same comparisons are held
to transformers' GPT-OSS MLP (the oracle), with the error bounds of ``tests/cell/test_moe.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptoss_patch.matrix import nz_rule
from gptoss_patch.selftest import worker as vllm_setup
from gptoss_patch.selftest.moe import (TOP_K, Weights, make_tokens, make_weights,  # noqa: F401
                                           moe_modules, reference, rel_err, select_moe_comm_type,
                                           set_default_torch_dtype)
from gptoss_patch.selftest.tiny import write_checkpoint
from gptoss_patch_testkit.harness import cell_layout

H_120B, I_120B_RANK = 2880, 360  # gpt-oss-120b hidden size; expert intermediate 2880 / TP 8
PADDED = 368
FP32_TOL = 1e-4
BF16_CAP = 2 ** -5
ND, NZ = 2, 29

# ----------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny GPT-OSS checkpoint (hidden 64, expert intermediate 360 - unaligned at TP 1 -, 4 experts, 2 layers)."""
    path = tmp_path_factory.mktemp("padding_ckpt")
    write_checkpoint(path, preset="tiny", seed=3, tokenizer=False, num_hidden_layers=2, num_local_experts=4,
                     vocab_size=512, pad_token_id=511, eos_token_id=510)
    return path


@pytest.fixture(scope="session")
def configs(ckpt):
    """Engine configs: ``configs(name)``, name in bf16, fp32, bf16_ep."""
    cache = {}
    args = {"bf16": {}, "fp32": {"dtype": "float32"}, "bf16_ep": {"enable_expert_parallel": True}}

    def get(name):
        if name not in cache:
            cache[name] = vllm_setup.engine_config(ckpt, **args[name])
        return cache[name]

    return get


def assert_matches_oracle(out, w, x, dtype):
    """float32: relative error <= 1e-4. bfloat16: no worse than transformers' own MLP in bf16 plus one bf16 rounding,
    and <= 2**-5 (the criterion of tests/cell/test_moe.py)."""
    ref = reference(w, x)
    ours = rel_err(out, ref)
    if dtype == torch.float32:
        assert ours <= FP32_TOL, f"fp32 error {ours:.3e}"
    else:
        hf16 = rel_err(reference(w, x, torch.bfloat16), ref)
        assert ours <= hf16 + 2 ** -8, f"bf16 error {ours:.3e} vs transformers bf16 {hf16:.3e}"
        assert ours <= BF16_CAP, f"bf16 error {ours:.3e}"
    return ours


# --------------------------------------------------------------------------------------------------- building layers


@pytest.fixture(scope="session")
def mods(layout):
    """The cell's MoE modules (:class:`gptoss_patch.selftest.moe.MoEModules`)."""
    return moe_modules(layout)


@pytest.fixture(scope="session")
def rule(cell):
    """The cell's :class:`gptoss_patch.matrix.NzRule`."""
    r = nz_rule(cell)
    assert r is not None, f"no NZ rule recorded for {cell}"
    return r


@pytest.fixture(scope="session")
def nz_on(rule):
    """An NZ mode ``(VLLM_ASCEND_ENABLE_NZ, eagle)`` in which the cell's release casts bf16 MoE weights to NZ (the
    first of (1, no eagle), (1, eagle), (2, no eagle))."""
    return next(m for m in ((1, False), (1, True), (2, False)) if rule.casts(*m))


@contextlib.contextmanager
def nz_switch(cfg, mode, eagle):
    """``VLLM_ASCEND_ENABLE_NZ=mode`` and - on 0.11.x, whose ``is_enable_nz(dtype, vllm_config)`` caches it - the
    eagle flag, as upstream reads them (call inside :func:`vllm_setup.ascend_context`; everything is put back
    afterwards). 0.12.0rc1's ``is_enable_nz()`` and 0.13.0+'s ``maybe_trans_nz`` read the variable at each call and
    have no eagle condition (``eagle`` is then irrelevant)."""
    import vllm_ascend.utils as vu

    cached = hasattr(vu, "_ENABLE_NZ") and hasattr(vu, "_IS_EAGLE_MODE")
    old_env = os.environ.get("VLLM_ASCEND_ENABLE_NZ")
    old = (vu._ENABLE_NZ, vu._IS_EAGLE_MODE) if cached else None
    os.environ["VLLM_ASCEND_ENABLE_NZ"] = str(mode)
    try:
        if cached:
            vu._ENABLE_NZ = None
            vu.is_enable_nz(vllm_config=cfg)  # recomputes _ENABLE_NZ from the variable, _IS_EAGLE_MODE from cfg
            vu._IS_EAGLE_MODE = eagle  # what a speculative config with method "eagle"/"eagle3" sets
        yield
    finally:
        if cached:
            vu._ENABLE_NZ, vu._IS_EAGLE_MODE = old
        if old_env is None:
            os.environ.pop("VLLM_ASCEND_ENABLE_NZ", None)
        else:
            os.environ["VLLM_ASCEND_ENABLE_NZ"] = old_env


@contextlib.contextmanager
def pad_policy(value):
    """``GPTOSS_PATCH_MOE_PAD=value`` for the duration (``None``: unset = auto)."""
    old = os.environ.get("GPTOSS_PATCH_MOE_PAD")
    if value is None:
        os.environ.pop("GPTOSS_PATCH_MOE_PAD", None)
    else:
        os.environ["GPTOSS_PATCH_MOE_PAD"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GPTOSS_PATCH_MOE_PAD", None)
        else:
            os.environ["GPTOSS_PATCH_MOE_PAD"] = old


_names = itertools.count()
#: storages (data_ptr) of w13_weight / w13_bias / w2_weight when upstream's process_weights_after_loading starts
UPSTREAM_SAW: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {}


@pytest.fixture(autouse=True)
def _watch_upstream_entry(monkeypatch):
    """vllm-ascend 0.11.0's ``process_weights_after_loading`` begins with
    ``super(UnquantizedFusedMoEMethod, self).process_weights_after_loading(layer)`` (= ``QuantizeMethodBase``'s no-op):
    record, at that moment, the storage and shape of each expert tensor upstream is about to transpose."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    original = QuantizeMethodBase.process_weights_after_loading

    def spy(self, layer):
        if hasattr(layer, "w13_weight"):
            UPSTREAM_SAW[id(layer)] = {n: (getattr(layer, n).data_ptr(), tuple(getattr(layer, n).shape))
                                       for n in ("w13_weight", "w13_bias", "w2_weight") if hasattr(layer, n)}
        return original(self, layer)

    monkeypatch.setattr(QuantizeMethodBase, "process_weights_after_loading", spy)
    yield
    UPSTREAM_SAW.clear()


def build_layer(cfg, w, dtype, *, nz=None, policy=None, tp_rank=0, tp_size=1, num_experts=None):
    """The MoE layer of vLLM's ``gpt_oss.py`` ``MLPBlock`` holding tensor-parallel rank ``tp_rank`` of ``tp_size``'s
    weights, filled as vLLM 0.11.0's ``_load_weights_other`` does (``param.copy_`` of the interleaved column range
    ``2*start:2*end`` of ``gate_up_proj``, the row range of ``down_proj``, ``w2_bias`` on rank 0 only), then
    ``process_weights_after_loading`` (patched) with NZ mode ``nz = (mode, eagle)`` and padding policy ``policy``.

    Returns ``(layer, loaded)`` with ``loaded`` = ``{name: data_ptr}`` of the parameters the loader filled.
    """
    from vllm.model_executor.layers.fused_moe import FusedMoE

    e, h, i = w.dims
    per_rank = i // tp_size
    start, end = tp_rank * per_rank, (tp_rank + 1) * per_rank
    with vllm_setup.ascend_context(vllm_config=cfg), set_default_torch_dtype(dtype), \
            (nz_switch(cfg, *nz) if nz else contextlib.nullcontext()), pad_policy(policy):
        layer = FusedMoE(num_experts=num_experts or e, top_k=TOP_K, hidden_size=h, intermediate_size=per_rank,
                         reduce_results=True, renormalize=True, quant_config=None,
                         prefix=f"test_padding.{next(_names)}.experts", apply_router_weight_on_input=False,
                         has_bias=True, activation="swigluoai", is_sequence_parallel=False)
        with torch.no_grad():
            layer.w13_weight.copy_(w.w13[:, :, 2 * start:2 * end].permute(0, 2, 1).contiguous())
            layer.w2_weight.copy_(w.w2[:, start:end, :].permute(0, 2, 1).contiguous())
            layer.w13_bias.copy_(w.b13[:, 2 * start:2 * end])
            layer.w2_bias.copy_(w.b2 if tp_rank == 0 else torch.zeros_like(w.b2))
        loaded = {n: getattr(layer, n).data_ptr() for n in ("w13_weight", "w13_bias", "w2_weight")}
        layer.quant_method.process_weights_after_loading(layer)
    return layer, loaded


def run_layer(cfg, layer, w, x):
    """Router ``Linear`` (layer dtype) then the MoE layer, in vllm-ascend's forward context for ``len(x)`` tokens."""
    comm = moe_modules(cell_layout()).comm
    dtype = layer.w13_bias.dtype
    xd = x.to(dtype)
    with vllm_setup.ascend_context(vllm_config=cfg), torch.no_grad():
        comm.setup_moe_comm_method(layer.moe_config)
        logits = F.linear(xd, w.router_w.to(dtype), w.router_b.to(dtype))
        with vllm_setup.forward_context(cfg, xd.shape[0], moe_comm_type=select_moe_comm_type(cfg, xd.shape[0])):
            return layer(hidden_states=xd, router_logits=logits)


def fmt(t):
    import torch_npu

    return torch_npu.get_npu_format(t)


def upstream_got_loader_storages(layer, loaded):
    saw = UPSTREAM_SAW[id(layer)]
    return all(saw[n][0] == loaded[n] for n in loaded)


# -------------------------------------------------------------------------------------------------- patch plumbing


def test_patch_is_applied_to_the_release_method(mods, layout):
    import gptoss_patch
    from gptoss_patch import matrix

    states = {p.name: (p.state, p.target) for p in gptoss_patch.status().patches}
    assert states["nz_padding.pad_moe_intermediate"] == ("applied", matrix.LAYOUTS[layout]["moe_unquant_process_weights"])
    attr = mods.method_cls.__dict__["process_weights_after_loading"]
    assert getattr(attr, "_self_gptoss_patch_name", None) == "nz_padding.pad_moe_intermediate"


@pytest.mark.parametrize("mode, eagle", [(0, False), (1, False), (2, False), (0, True), (1, True), (2, True)])
def test_installed_wheel_nz_rule(configs, mods, rule, mode, eagle):
    """The wheel's own ``process_weights_after_loading`` NZ-casts bf16 experts exactly where
    ``gptoss_patch.matrix.NZ_RULES`` says for this release (docs/upstream.md §4.10), float32 experts never
    except where ``is_enable_nz`` decides (0.11.x, 0.12.0rc1: float32 is cast exactly when bf16 is; 0.13.0+'s
    ``maybe_trans_nz`` keeps float32 in ND), and :func:`gptoss_patch.patches.nz_padding.upstream_nz_cast` (what the
    padding decides on) gives the same answers. Aligned layer (I = 96), padding off."""
    import vllm_ascend.utils as vu

    from gptoss_patch.patches.nz_padding import upstream_nz_cast

    cfg = configs("bf16")
    w = make_weights(4, 64, 96, seed=4).rounded(torch.bfloat16)
    layer, _ = build_layer(cfg, w, torch.bfloat16, nz=(mode, eagle), policy="never")
    want = rule.casts(mode, eagle)
    assert (fmt(layer.w13_weight), fmt(layer.w2_weight)) == ((NZ, NZ) if want else (ND, ND))
    original = mods.method_cls.__dict__["process_weights_after_loading"].__wrapped__
    with vllm_setup.ascend_context(vllm_config=cfg), nz_switch(cfg, mode, eagle):
        assert upstream_nz_cast(original, torch.bfloat16) is want
        assert upstream_nz_cast(original, torch.float32) is (want and hasattr(vu, "is_enable_nz"))


# ---------------------------------------------------------------------------- the failure the patch exists for


def test_unpatched_nz_path_fails_like_the_operator(configs, monkeypatch, mods, nz_on):
    """Without the padding patch, NZ on (the cell's NZ mode): upstream casts ``w2 (E, 360, 2880)`` to NZ and the grouped
    matmul rejects it with the operator's ACLNN_ERR_PARAM_INVALID text - at the first MoE call, not at load."""
    cls = mods.method_cls
    monkeypatch.setattr(cls, "process_weights_after_loading", cls.__dict__["process_weights_after_loading"].__wrapped__)
    cfg = configs("bf16")
    w = make_weights(4, H_120B, I_120B_RANK, seed=1).rounded(torch.bfloat16)
    layer, _ = build_layer(cfg, w, torch.bfloat16, nz=nz_on)
    assert tuple(layer.w2_weight.shape) == (4, 360, 2880) and fmt(layer.w2_weight) == NZ and fmt(layer.w13_weight) == NZ
    x = make_tokens(w, 8, seed=2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"When weight\(DT_BF16\) format is FRACTAL_NZ, weight'shape\(k\[360\], "
                                           r"n\[2880\]\) should be divisible .*ACLNN_ERR_PARAM_INVALID"):
        run_layer(cfg, layer, w, x)


# ----------------------------------------------------------------------------- 120b per-rank dims, NZ modes 0/1/2


@pytest.fixture(scope="module")
def w120():
    """gpt-oss-120b per-rank shapes at TP 8 (hidden 2880, intermediate 360), 4 experts instead of 128, bf16 values."""
    w = make_weights(4, H_120B, I_120B_RANK, seed=120).rounded(torch.bfloat16)
    return w, make_tokens(w, 256, seed=121, dtype=torch.bfloat16, min_gap=0.1)


@pytest.mark.parametrize("mode, eagle", [(0, True), (1, False), (1, True), (2, False), (2, True)],
                         ids=["mode0", "mode1", "mode1-eagle", "mode2", "mode2-eagle"])
def test_nz_modes_at_120b_rank_dims(configs, w120, rule, mode, eagle):
    """bf16 at the real per-rank dims, padded exactly where the release NZ-casts (``NZ_RULES``: 0.11.0 mode 1/2 with
    eagle, 0.12.0rc1 mode 1/2, 0.13.0+ mode 2). Padded (NZ): ``w13 (E, 2880, 736)``, ``w2 (E, 368, 2880)`` in
    FRACTAL_NZ, zero pairs / rows, and the MoE output matches transformers. Not padded (ND): upstream receives the very
    storages the loader filled (nothing copied) and keeps the original shapes."""
    padded = rule.casts(mode, eagle)
    cfg = configs("bf16")
    w, x = w120
    layer, loaded = build_layer(cfg, w, torch.bfloat16, nz=(mode, eagle))
    saw = UPSTREAM_SAW[id(layer)]
    if padded:
        assert saw["w13_weight"][1] == (4, 2 * PADDED, 2880) and saw["w2_weight"][1] == (4, 2880, PADDED)
        assert saw["w13_bias"][1] == (4, 2 * PADDED)
        assert tuple(layer.w13_weight.shape) == (4, 2880, 2 * PADDED)
        assert tuple(layer.w2_weight.shape) == (4, PADDED, 2880)
        assert (fmt(layer.w13_weight), fmt(layer.w2_weight)) == (NZ, NZ)
        assert layer._gptoss_moe_padding == (360, PADDED)
        # the padding is whole zero gate/up pairs (columns 720.. of w13 after upstream's transpose) and zero w2 rows
        assert not layer.w13_weight[:, :, 720:].any() and not layer.w13_bias[:, 720:].any()
        assert not layer.w2_weight[:, 360:, :].any()
        assert torch.equal(layer.w13_weight[:, :, :720].float(), w.w13)
        assert torch.equal(layer.w13_bias[:, :720].float(), w.b13)
        assert torch.equal(layer.w2_weight[:, :360, :].float(), w.w2)
    else:
        assert upstream_got_loader_storages(layer, loaded)
        assert tuple(layer.w13_weight.shape) == (4, 2880, 720) and tuple(layer.w2_weight.shape) == (4, 360, 2880)
        assert (fmt(layer.w13_weight), fmt(layer.w2_weight)) == (ND, ND)
        assert not hasattr(layer, "_gptoss_moe_padding")
    for n in (1, 256):
        assert_matches_oracle(run_layer(cfg, layer, w, x[:n]), w, x[:n], torch.bfloat16)


def test_float32_padding_policy_always(configs):
    """float32 weights in ND (``VLLM_ASCEND_ENABLE_NZ=0``: 0.12.0rc1 would otherwise NZ-cast them too, and the grouped
    matmul takes no fp32 NZ weight at all): ``auto`` leaves them alone, ``GPTOSS_PATCH_MOE_PAD=always`` pads them in ND;
    both match transformers in float32."""
    cfg = configs("fp32")
    w = make_weights(4, H_120B, I_120B_RANK, seed=7)
    x = make_tokens(w, 64, seed=8)
    plain, loaded = build_layer(cfg, w, torch.float32, nz=(0, False))
    assert upstream_got_loader_storages(plain, loaded) and tuple(plain.w2_weight.shape) == (4, 360, 2880)
    padded, _ = build_layer(cfg, w, torch.float32, nz=(0, False), policy="always")
    assert tuple(padded.w2_weight.shape) == (4, PADDED, 2880) and fmt(padded.w2_weight) == ND
    a, b = run_layer(cfg, plain, w, x), run_layer(cfg, padded, w, x)
    assert_matches_oracle(a, w, x, torch.float32)
    assert_matches_oracle(b, w, x, torch.float32)
    # not bit-exact here: CPU BLAS sums K = 360 and K = 368 in different orders (see the module docstring)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


def test_policy_never_and_non_gptoss_layers_are_untouched(configs, nz_on):
    cfg = configs("bf16")
    w = make_weights(4, 64, I_120B_RANK, seed=9).rounded(torch.bfloat16)
    layer, loaded = build_layer(cfg, w, torch.bfloat16, nz=nz_on, policy="never")
    assert upstream_got_loader_storages(layer, loaded) and tuple(layer.w2_weight.shape) == (4, 360, 64)


# ------------------------------------------------------------------------------------------ exactness in float32


_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("padding_case", {path!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print("PADDING_EXACT " + json.dumps(mod.exact_comparisons({ckpt!r})))
"""


def exact_comparisons(ckpt_dir):
    """Child-process body of :func:`test_padding_is_bit_exact_in_float32` (run with ``MKL_CBWR=COMPATIBLE``).

    Returns a JSON-ready dict: the BLAS precondition (zero-padding K changes no bit of a float32 product in this
    process) and, at 120b per-rank dims (4 experts, hidden 2880, intermediate 360 -> 368, 256 tokens), whether the
    padded layer's output is bit-identical (``torch.equal``) to the unpadded one: float32 (ND, policy always vs auto)
    and bf16 with float32 accumulation (modes 1 and 2 with the eagle flag - NZ and padded where the release casts -
    vs ND mode 0).
    """
    import gptoss_patch

    gptoss_patch.activate(source="test")
    g = torch.Generator().manual_seed(5)
    a, m = torch.randn(256, 360, generator=g), torch.randn(360, 2880, generator=g)
    pre = torch.equal(a @ m, F.pad(a, (0, 8)) @ F.pad(m, (0, 0, 0, 8)))
    out: dict = {"blas_precondition": pre}
    cfg32 = vllm_setup.engine_config(ckpt_dir, dtype="float32")
    w = make_weights(4, H_120B, I_120B_RANK, seed=77)
    x = make_tokens(w, 256, seed=78)
    plain, _ = build_layer(cfg32, w, torch.float32, nz=(0, False))
    padded, _ = build_layer(cfg32, w, torch.float32, nz=(0, False), policy="always")
    y0, y1 = run_layer(cfg32, plain, w, x), run_layer(cfg32, padded, w, x)
    out["fp32"] = {"shapes": [list(plain.w2_weight.shape), list(padded.w2_weight.shape)], "equal": torch.equal(y0, y1),
                   "max_abs_diff": (y0 - y1).abs().max().item()}
    cfg16 = vllm_setup.engine_config(ckpt_dir)
    w = w.rounded(torch.bfloat16)
    x = make_tokens(w, 256, seed=79, dtype=torch.bfloat16)
    nd, _ = build_layer(cfg16, w, torch.bfloat16, nz=(0, True))
    ref = run_layer(cfg16, nd, w, x)
    out["bf16_mode0_shape"] = list(nd.w2_weight.shape)
    for mode in (1, 2):
        lay, _ = build_layer(cfg16, w, torch.bfloat16, nz=(mode, True))
        y = run_layer(cfg16, lay, w, x)
        out[f"bf16_mode{mode}"] = {"shape": list(lay.w2_weight.shape), "format": fmt(lay.w2_weight),
                                   "equal": torch.equal(ref, y),
                                   "max_abs_diff": (ref.float() - y.float()).abs().max().item()}
    return out


def test_padding_is_bit_exact_in_float32(ckpt, rule):
    """The acceptance check: with an accumulation order that does not depend on K (MKL_CBWR=COMPATIBLE, the CPU
    stand-in for the cube's in-order K walk), the padded MoE output equals the unpadded one bit for bit - float32
    weights, and bf16 weights in NZ modes 1 and 2 where the release casts (float32 accumulation inside the grouped
    matmul) against ND mode 0; where it does not cast, the layer stays ND at 360 and equal all the same."""
    env = dict(os.environ, MKL_CBWR="COMPATIBLE", GPTOSS_PATCH_SIMULATE_NPU="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_STREAM="ext://sys.stderr")
    env.pop("GPTOSS_PATCH_MOE_PAD", None)
    code = _CHILD.format(path=str(Path(__file__).resolve()), ckpt=str(ckpt))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PADDING_EXACT ")]
    assert lines, f"child failed ({proc.returncode}): {proc.stderr[-3000:]}"
    r = json.loads(lines[-1][len("PADDING_EXACT "):])
    assert r["blas_precondition"], "MKL_CBWR=COMPATIBLE did not give a K-independent float32 product on this machine"
    assert r["fp32"]["shapes"] == [[4, 360, 2880], [4, PADDED, 2880]]
    assert r["fp32"]["equal"], r["fp32"]
    assert r["bf16_mode0_shape"] == [4, 360, 2880]
    for mode in (1, 2):
        casts = rule.casts(mode, eagle=True)
        assert r[f"bf16_mode{mode}"]["shape"] == [4, PADDED if casts else 360, 2880]
        assert r[f"bf16_mode{mode}"]["format"] == (NZ if casts else ND)
        assert r[f"bf16_mode{mode}"]["equal"], r[f"bf16_mode{mode}"]
    assert any(rule.casts(mode, eagle=True) for mode in (1, 2))  # the padded NZ path was exercised


# --------------------------------------------------------------------------- tensor parallel sizes, expert parallel


@pytest.mark.parametrize("tp_size, per_rank, padded_to", [(1, 2880, None), (2, 1440, None), (4, 720, None),
                                                          (8, 360, 368), (16, 180, 192)])
def test_every_tensor_parallel_size(configs, nz_on, tp_size, per_rank, padded_to):
    """gpt-oss's intermediate 2880 split over TP ranks (hidden 64 to keep it small; 4 experts), NZ on (the cell's NZ
    mode): each rank's layer is padded exactly when ``2880 / TP`` is not a multiple of 16, aligned ranks are not
    copied, every rank runs on NZ weights, and the sum over ranks (the all-reduce) matches transformers."""
    cfg = configs("bf16")
    w = make_weights(4, 64, 2880, seed=30 + tp_size).rounded(torch.bfloat16)
    x = make_tokens(w, 48, seed=31, dtype=torch.bfloat16, min_gap=0.1)
    total = None
    for r in range(tp_size):
        layer, loaded = build_layer(cfg, w, torch.bfloat16, nz=nz_on, tp_rank=r, tp_size=tp_size)
        inter = padded_to or per_rank
        assert tuple(layer.w2_weight.shape) == (4, inter, 64) and fmt(layer.w2_weight) == NZ
        if padded_to is None:
            assert upstream_got_loader_storages(layer, loaded)
        else:
            assert layer._gptoss_moe_padding == (per_rank, padded_to)
        out = run_layer(cfg, layer, w, x).float()
        total = out if total is None else total + out
        del layer
    assert_matches_oracle(total, w, x, torch.bfloat16)


@pytest.mark.parametrize("inter, padded_to", [(2880, None), (360, 368)])
def test_expert_parallel(configs, nz_on, inter, padded_to):
    """With expert parallelism a rank holds whole experts (vLLM: MoE TP size 1): gpt-oss's 2880 is aligned and not
    copied; a checkpoint whose full intermediate is unaligned (the tiny preset's 360) is padded the same way on every
    EP rank. The layer is built as one EP rank's (4 of 8 experts) under the expert-parallel config, NZ on."""
    cfg = configs("bf16_ep")
    assert cfg.parallel_config.enable_expert_parallel
    w = make_weights(4, 64, inter, seed=40 + inter).rounded(torch.bfloat16)
    x = make_tokens(w, 32, seed=41, dtype=torch.bfloat16)
    layer, loaded = build_layer(cfg, w, torch.bfloat16, nz=nz_on)
    assert layer.expert_map is None  # one process: ep_size 1 (vLLM), the local experts are all of w's
    assert tuple(layer.w2_weight.shape) == (4, padded_to or inter, 64) and fmt(layer.w2_weight) == NZ
    if padded_to is None:
        assert upstream_got_loader_storages(layer, loaded)
    assert_matches_oracle(run_layer(cfg, layer, w, x), w, x, torch.bfloat16)


# ------------------------------------------------------------------------------------- vLLM's own loader, end to end


def test_whole_model_through_vllms_loader_with_nz(ckpt, configs, mods, nz_on):
    """vLLM's ``GptOssForCausalLM`` loaded by vLLM 0.11.0's loader from the tiny checkpoint (intermediate 360: unaligned
    at TP 1) with NZ on: the loader's ``param.copy_`` of unpadded slices works (padding happens after loading), every
    layer ends padded to 368 in NZ, and every layer's MLP matches transformers' model loaded from the same files."""
    from transformers import GptOssForCausalLM

    cfg = configs("bf16")
    with vllm_setup.ascend_context(vllm_config=cfg), nz_switch(cfg, *nz_on):
        model = vllm_setup.load_model(cfg)
    hf = GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for i, block in enumerate(model.model.layers):
        experts = block.mlp.experts
        assert tuple(experts.w13_weight.shape) == (4, 64, 2 * PADDED)
        assert tuple(experts.w2_weight.shape) == (4, PADDED, 64)
        assert (fmt(experts.w13_weight), fmt(experts.w2_weight)) == (NZ, NZ)
        hm = hf.model.layers[i].mlp
        w = Weights(*(t.detach().float().clone() for t in (hm.router.weight, hm.router.bias, hm.experts.gate_up_proj,
                                                            hm.experts.gate_up_proj_bias, hm.experts.down_proj,
                                                            hm.experts.down_proj_bias)))
        x = make_tokens(w, 64, seed=50 + i, dtype=torch.bfloat16, min_gap=0.1)
        with vllm_setup.ascend_context(vllm_config=cfg), torch.no_grad():
            mods.comm.setup_moe_comm_method(experts.moe_config)
            with vllm_setup.forward_context(cfg, x.shape[0], moe_comm_type=select_moe_comm_type(cfg, x.shape[0])):
                out = block.mlp(x.to(torch.bfloat16))
        assert_matches_oracle(out, w, x, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- verify --model


def test_verify_model_option(tmp_path, capsys, monkeypatch, cell, rule):
    """``python -m gptoss_patch.verify --model DIR --tensor-parallel-size N`` on a gpt-oss-120b config.json: the
    checkpoint report (:func:`gptoss_patch.tools.checkpoint.moe_padding_facts`, the one answer) states the per-rank
    intermediate, its padded size and the cell's NZ rule (0.11.0: only with eagle; 0.12.0rc1: yes by default; 0.13.0+:
    no unless ``VLLM_ASCEND_ENABLE_NZ=2``)."""
    from gptoss_patch import verify
    from gptoss_patch.tools.checkpoint import moe_padding_facts
    from gptoss_patch.selftest.tiny import config_for

    config_for("120b-rank", num_hidden_layers=36, num_local_experts=128).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    monkeypatch.delenv("GPTOSS_PATCH_MOE_PAD", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # verify --json sets it; restored afterwards
    r = moe_padding_facts(config, 8)
    padded_by_default = 368 if rule.casts(1) else None  # set only when the answer is yes
    assert (config["num_local_experts"], r["intermediate_size_per_rank"], r["intermediate_padded_to"]) == \
        (128, 360, padded_by_default)
    default_line = ("yes (vllm-ascend" if rule.casts(1) else
                    "only with eagle/eagle3 speculative decoding" if rule.casts(1, eagle=True) else
                    f"no (vllm-ascend {cell} keeps")
    assert r["intermediate_padding"].startswith(default_line)
    assert moe_padding_facts(config, 4)["intermediate_padded_to"] is None
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "2")
    assert moe_padding_facts(config, 16)["intermediate_padding"].startswith(
        "yes (vllm-ascend" if rule.casts(2) else "only with eagle")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    assert moe_padding_facts(config, 16)["intermediate_padding"].startswith(f"no (vllm-ascend {cell} keeps")
    monkeypatch.setenv("GPTOSS_PATCH_MOE_PAD", "always")
    forced = moe_padding_facts(config, 16)
    assert (forced["intermediate_padding"], forced["intermediate_padded_to"]) == \
        ("yes (GPTOSS_PATCH_MOE_PAD=always)", 192)
    monkeypatch.delenv("GPTOSS_PATCH_MOE_PAD")
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ")
    # the CLI (a config-only directory: the checkpoint report also names the missing safetensors; not asserted here)
    verify.main(["--model", str(tmp_path), "--tensor-parallel-size", "8", "--no-children", "--json"])
    facts = json.loads(capsys.readouterr().out)["checkpoint"]["facts"]
    assert (facts["intermediate_size_per_rank"], facts["intermediate_padded_to"]) == (360, padded_by_default)
    assert facts["intermediate_padding"].startswith(default_line)
    verify.main(["--model", str(tmp_path), "--tensor-parallel-size", "8", "--no-children"])
    printed = capsys.readouterr().out
    assert "intermediate size per rank: 360" in printed
    assert ("intermediate padded to: 368" in printed) == (padded_by_default == 368)
    assert f"intermediate padding: {default_line}" in printed
    assert verify.main(["--model", str(tmp_path / "missing"), "--no-children"]) == 1
