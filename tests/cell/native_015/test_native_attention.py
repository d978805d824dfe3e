"""Attention calibration: vllm-ascend's native GPT-OSS attention on the simulator vs transformers, per native cell
(0.15.0rc1, 0.16.0rc1, 0.17.0rc1, 0.18.0, 0.19.1rc1).

vllm-ascend 0.15.0rc1 supports GPT-OSS natively and was validated on hardware (PR #5901: TP=2, eager,
gpt-oss-20b-BF16); the eager attention path below is the same in every native release tested here (0.17+ read
``_EXTRA_CTX.capturing`` instead of ``forward_context.capturing``), except the sliding layers' mask: up to 0.18.0
they get the builder's ``swa_mask``, from 0.19.1rc1 on the ``attn_mask`` template (PR #8387). Its eager
``AscendAttentionBackendImpl.forward`` - sinks passed to
``npu_fused_infer_attention_score_v2(learnable_sink=...)`` in TND layout, full layers with ``sparse_mode=3``
and the causal template ``attn_mask``, sliding layers with ``sparse_mode=4``, ``pre_tokens=sliding_window``,
``next_tokens=0`` and the builder's ``swa_mask`` (docs/upstream.md §4.3) - runs here unmodified, fed by
the release's own ``AscendAttentionMetadataBuilder.build``; the oracle is transformers' GPT-OSS
``eager_attention_forward`` with its ``causal_mask_function`` / ``sliding_window_causal_mask_function``
(:func:`gptoss_patch.selftest.attention.reference_output`).

Geometry: GQA 8:1 with head_dim 64 (gpt-oss-120b per rank at TP=8); states PrefillNoCache, ChunkedPrefill and
DecodeOnly (the three an eager 0.15 run with chunked prefill reaches: ``NPUModelRunner._build_attn_state``).
Tensors: query ``[T, 8, 64]``, key/value ``[T, 1, 64]``, caches ``[num_blocks, 128, 1, 64]``, output
``[T, 8, 64]``; float32 unless stated (float32 is a simulator extension, see npu_sim.ops.attention).
"""

import dataclasses

import pytest
import torch

from conftest import ROW

from gptoss_patch import matrix
from gptoss_patch.selftest import native as n015
from gptoss_patch.selftest.attention import reference_output

N, KVN, D, WINDOW = 8, 1, 64, 128

STATES = {
    "PrefillNoCache": [(0, 300), (0, 129), (0, 1)],
    "ChunkedPrefill": [(300, 1), (0, 200), (150, 60), (129, 1), (0, 3)],
    "DecodeOnly": [(127, 1), (128, 1), (129, 1), (300, 1), (255, 1), (256, 1)],
}


@pytest.fixture(scope="module")
def cfg():
    config, _ = n015.vllm_context()
    return config


@pytest.fixture
def fia_calls(monkeypatch):
    """Records the keyword arguments of every ``torch_npu.npu_fused_infer_attention_score_v2`` call that
    vllm-ascend's attention module makes (it looks the operator up on ``torch_npu`` at call time)."""
    import vllm_ascend.attention.attention_v1 as aa

    import functools

    calls = []
    real = aa.torch_npu.npu_fused_infer_attention_score_v2

    @functools.wraps(real)  # keeps the signature: gptoss_patch.kernels.attention.detect_path reads learnable_sink
    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(aa.torch_npu, "npu_fused_infer_attention_score_v2", spy)
    return calls


def _state(name):
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    return getattr(AscendAttentionState, name)


def _sinks(dtype=torch.float32):
    return (torch.randn(N, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)


def _has_swa_mask() -> bool:
    """True when the installed ``AscendMetadata`` still has ``swa_mask`` (vllm-ascend <= 0.18.0; removed by PR #8387,
    first in 0.19.1rc1). Cross-checked against the matrix row, whose attention note names the swa_mask exactly then."""
    from vllm_ascend.attention.attention_v1 import AscendMetadata

    has = "swa_mask" in {f.name for f in dataclasses.fields(AscendMetadata)}
    assert has == ("swa_mask" in ROW.caps["attention"].note), (has, ROW.caps["attention"].note)
    return has


def _template_metadata(md):
    """``md`` with the sliding layers reading the documented template: ``swa_mask`` replaced by ``attn_mask`` (what
    upstream passes after PR #8387), or ``md`` itself where the release already passes ``attn_mask``."""
    return dataclasses.replace(md, swa_mask=md.attn_mask) if _has_swa_mask() else md


def _positions(seqs):
    """Absolute position of every query row of the batch, in token order."""
    return torch.cat([torch.arange(c, c + k) for c, k in seqs])


def test_calibration_runs_upstream_attention_untouched(cfg):
    """The calibration is only meaningful if nothing of ours touches the vllm-ascend attention it runs: the decision
    in this process is the cell row's verdict with exactly its layout's patches; on layouts H and G (0.15.0rc1 -
    0.18.0) only ``forward_impl`` is wrapped (``attention.sink_window_forward_impl``) - ``run_native_forward(...,
    upstream=True)`` binds upstream's original on the calibrated impl, checked here to reach upstream's fused call;
    on layout I (0.19.1rc1) only ``__init__`` (``attention.band_128_keys``), which leaves an impl built outside a
    GPT-OSS model - the calibration's (``make_impl(..., gpt_oss=False)``) - with upstream's window. Besides, the
    FULL_DECODE_ONLY graph patches: ``update_graph_params`` (H, G, I) and ``full_graph_fia`` (I), which an eager
    forward never calls."""
    import wrapt

    import gptoss_patch
    import vllm_ascend.attention.attention_v1 as aa

    from gptoss_patch.registry import MARKER

    def is_wrapped(v):  # wrapt 2.x: FunctionWrapper is not an ObjectProxy subclass
        return isinstance(v, (wrapt.FunctionWrapper, wrapt.ObjectProxy)) or hasattr(v, MARKER)

    assert is_wrapped(wrapt.FunctionWrapper(len, lambda w, i, a, k: w(*a, **k)))  # the check sees a wrapper
    status = gptoss_patch.status()
    assert status.decision == ROW.verdict and status.row == ROW.vllm_ascend
    want = list(matrix.LAYOUT_PATCHES[ROW.layout]) if ROW.verdict == matrix.APPLY else []
    assert [p.name for p in status.patches] == want and all(p.state == "applied" for p in status.patches)
    ours = [p.target for p in status.patches if p.target.startswith("vllm_ascend.attention")]
    wrapped = {"H": "forward_impl", "G": "forward_impl", "I": "__init__"}[ROW.layout]
    # FULL_DECODE_ONLY capture (I) and update (H, G, I): graph mode only, never on the calibration's eager forward
    graph = {"H": ["update_graph_params"], "G": ["update_graph_params"],
             "I": ["full_graph_fia", "update_graph_params"]}[ROW.layout]
    assert ours == [f"vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.{m}" for m in [wrapped, *graph]]
    for name in ("__init__", "forward", "forward_impl", "forward_fused_infer_attention"):
        assert is_wrapped(aa.AscendAttentionBackendImpl.__dict__[name]) == (name == wrapped), name
    calibrated = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW, sinks=_sinks(),
                                gpt_oss=False)
    assert calibrated.sliding_window == WINDOW and not hasattr(calibrated, "gptoss_window")


if not matrix.native_attention(ROW):  # layouts H and G
    @pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
    @pytest.mark.parametrize("state", list(STATES))
    def test_patched_forward_matches_transformers_window_128(cfg, fia_calls, state, window):
        """Layouts H and G (0.15.0rc1 - 0.18.0): the release's ``forward`` with ``attention.sink_window_forward_impl``
        equals transformers with GPT-OSS's own 128-key window (and the full-attention layers too), float32, <= 1e-5, in
        every state - where upstream alone is refused by the simulator (finding 1, ``swa_mask``) and, with PR #8387's
        template, attends 129 keys (finding 2, above).

        The operator call is one TND launch over the paged cache with the template mask and ``pre_tokens = 127`` on the
        sliding layers (gptoss_patch.kernels.attention ``band``), ``learnable_sink`` = the impl's sinks; upstream's own
        swa_mask is never read. Defined only where our call replaces upstream's forward (layouts H and G; on 0.19.1rc1
        upstream's forward runs with GPT-OSS's band, the test after this one).
        """
        seqs = STATES[state]
        case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=21, sliding_window=window)
        sinks = _sinks()
        impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=window, sinks=sinks)
        out = n015.run_native_forward(cfg, impl, case)
        from gptoss_patch.kernels import attention as kernels

        assert kernels.chosen_path() == kernels.V2  # the operator path a torch_npu with learnable_sink takes
        assert len(fia_calls) == 1, fia_calls
        call = fia_calls[0]
        assert call["input_layout"] == "TND" and call["learnable_sink"] is impl.sinks
        assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"]) == \
            ((4, WINDOW - 1, 0) if window else (3, 2147483647, 0)), call
        assert torch.equal(call["atten_mask"].bool(), torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
        assert call["atten_mask"] is not getattr(case.metadata, "swa_mask", None)
        ref = reference_output(case, sinks=sinks, sliding_window=window, scale=impl.scale)
        err = (out - ref).abs().max().item()
        assert err <= 1e-5, f"max abs error {err} against transformers (window {window})"
        if window:
            ref129 = reference_output(case, sinks=sinks, sliding_window=WINDOW + 1, scale=impl.scale)
            pos = _positions(seqs)
            assert (out - ref129).abs().amax(dim=(1, 2))[pos >= WINDOW].min().item() > 1e-3  # not upstream's band


if ROW.layout == "I":  # 0.19.1rc1: upstream's forward, GPT-OSS's sliding impls built with pre_tokens 127
    @pytest.mark.parametrize("state", list(STATES))
    def test_upstream_forward_of_a_gpt_oss_built_impl_attends_128_keys(cfg, fia_calls, state):
        """``attention.band_128_keys``: an impl built as GPT-OSS builds it (inside ``GptOssForCausalLM.__init__``;
        ``make_impl`` marks it so) runs upstream's own eager forward with ``pre_tokens = 127`` and equals transformers
        with GPT-OSS's 128-key window (float32, <= 1e-5) in every state - and not the 129-key band (> 1e-3 on every row
        at position >= 128), which the same upstream forward computes for an impl built outside a GPT-OSS model
        (finding 2, below)."""
        seqs = STATES[state]
        case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=21, sliding_window=WINDOW)
        sinks = _sinks()
        impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW, sinks=sinks)
        assert (impl.sliding_window, impl.gptoss_window) == (WINDOW - 1, WINDOW)
        out = n015.run_native_forward(cfg, impl, case)
        assert len(fia_calls) == 1, fia_calls
        call = fia_calls[0]
        assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"], call["input_layout"]) == \
            (4, WINDOW - 1, 0, "TND")
        assert call["atten_mask"] is case.metadata.attn_mask and call["learnable_sink"] is impl.sinks
        ref = reference_output(case, sinks=sinks, sliding_window=WINDOW, scale=impl.scale)
        assert (out - ref).abs().max().item() <= 1e-5
        ref129 = reference_output(case, sinks=sinks, sliding_window=WINDOW + 1, scale=impl.scale)
        assert (out - ref129).abs().amax(dim=(1, 2))[_positions(seqs) >= WINDOW].min().item() > 1e-3


@pytest.mark.parametrize("state", list(STATES))
def test_full_attention_layer_matches_transformers_float32(cfg, fia_calls, state):
    """Full-attention layers: the simulator reproduces transformers exactly (max abs error <= 1e-5, float32).

    Native call (attention_v1.py ``forward_fused_infer_attention``): ``sparse_mode=3``,
    ``atten_mask=attn_metadata.attn_mask`` (the builder's ``triu(ones(2048, 2048), 1).to(int8)``),
    ``pre_tokens=SWA_INT_MAX``, ``learnable_sink=self.sinks`` - the documented right-down causal rule
    (docs/operators.md §3.3) plus the sink in the denominator (§3.3), which is exactly HF's causal mask with the sink
    column of ``eager_attention_forward``.
    """
    seqs = STATES[state]
    case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=11)
    assert case.state == _state(state)
    md = case.metadata
    assert md.attn_mask.dtype == torch.int8 and torch.equal(
        md.attn_mask, torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8))
    sinks = _sinks()
    impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=None, sinks=sinks)
    out = n015.run_native_forward(cfg, impl, case, upstream=True)
    assert len(fia_calls) == 1
    call = fia_calls[0]
    assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"], call["input_layout"]) == \
        (3, 2147483647, 0, "TND")
    assert call["atten_mask"] is md.attn_mask and call["learnable_sink"] is sinks
    ref = reference_output(case, sinks=sinks, sliding_window=None, scale=impl.scale)
    err = (out - ref).abs().max().item()
    assert err <= 1e-5, f"max abs error {err}"


def test_full_attention_layer_bfloat16_within_one_rounding(cfg):
    """The model's real dtypes: bf16 q/k/v/cache and bf16 sinks (vllm-ascend passes the model parameter as is).

    Bound: the operator computes in float32 and rounds its output to bf16 once, so
    ``|err| <= 2^-8 * |out| <= 2^-8 * max|v|`` (8 significant bits; the output is a convex combination of value
    rows scaled by <= 1 with sinks), against the float32 reference on the same bf16-rounded inputs.
    """
    case = n015.build_case(cfg, STATES["ChunkedPrefill"], num_heads=N, num_kv_heads=KVN, dtype=torch.bfloat16, seed=3)
    sinks = _sinks(torch.bfloat16)
    impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=None, sinks=sinks)
    out = n015.run_native_forward(cfg, impl, case, upstream=True)
    assert out.dtype == torch.bfloat16
    ref = reference_output(case, sinks=sinks, sliding_window=None, scale=impl.scale)
    bound = 2 ** -8 * max(v.abs().max().item() for v in case.full_v)
    assert (out.float() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("state", list(STATES))
def test_sliding_layer_mask_swa_mask_refused_by_the_simulator_where_the_real_op_runs(cfg, fia_calls, state):
    """Calibration finding 1: the ``swa_mask`` of 0.15.0rc1 ... 0.18.0 with ``sparse_mode=4``; gone in 0.19.1rc1.

    What 0.15.0rc1 ... 0.18.0 pass (attention_mask.py ``get_swa_mask``): a bool ``(2048, 2048)`` mask
    ``triu(ones, 1) | tril(ones, -sliding_window)`` - a band, not the lower-triangular template.

    What the documentation says (torch_npu ``npu_fused_infer_attention_score_v2``, op-plugin 26.0.0 English
    doc, "Q_S > 1 Constraints"): for sparse_mode 2/3/4 the mask "must be (S, S), (1, S, S) or (1, 1, S, S),
    where S must be 2048. The provided atten_mask must be a lower triangular matrix. If atten_mask is
    omitted or has an invalid shape, an error is raised." The raise is documented for a missing mask or a
    wrong shape only; this mask has the documented shape and a documented dtype (bool), so **the real operator
    accepts it** (its host-side tiling sees shapes, not the device-resident mask values). What it then
    computes is not documented: the PFA kernel (ops-transformer ``prompt_flash_attention_s1s2_bns1_mla_baseapi.h``,
    ``ComputeAttenMaskOffset`` / ``GetAttenMaskComputeMode``, BAND_MODE) reads the mask tile by tile at offsets
    derived from pre/next tokens, masking where it is 1 on the next-token edge and where it is 0 on the
    pre-token edge, and chooses per tile which edge pass runs assuming the template - so a band-shaped mask gives
    a tiling-dependent key set. Upstream removed ``swa_mask`` for this reason (e15d766aba, PR #8387, first in
    v0.19.1rc1: "Fix the atten_mask in the npu_fused_infer_attention_score_v2").

    The simulator cannot reproduce undocumented, tiling-dependent behaviour and refuses the call with a
    ``RuntimeError`` (npu_sim.ops.attention: template content check for modes 2-4). That is a known,
    deliberate deviation from the real operator (stricter), pinned here: if the simulator ever accepts this
    mask, this test fails and the calibration must be revisited.

    0.19.1rc1 (PR #8387): ``AscendMetadata`` has no ``swa_mask``; the sliding call passes ``attn_metadata.attn_mask``
    (the int8 template) with the same ``sparse_mode=4``, ``pre_tokens=128``, ``next_tokens=0``, and the simulator
    runs it (every output row written, finite); what it computes is finding 2.
    """
    seqs = STATES[state]
    case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=5, sliding_window=WINDOW)
    md = case.metadata
    impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW, sinks=_sinks(), gpt_oss=False)
    if not _has_swa_mask():
        out = n015.run_native_forward(cfg, impl, case, upstream=True)
        call = fia_calls[0]
        assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"]) == (4, WINDOW, 0)
        assert call["atten_mask"] is md.attn_mask and md.attn_mask.dtype == torch.int8
        assert torch.isfinite(out).all()
        return
    ones = torch.ones(2048, 2048, dtype=torch.bool)
    assert md.swa_mask.dtype == torch.bool and tuple(md.swa_mask.shape) == (2048, 2048)  # documented shape/dtype
    assert torch.equal(md.swa_mask, torch.triu(ones, 1) | torch.tril(ones, -WINDOW))
    with pytest.raises(RuntimeError, match=r"sparse_mode=4 must be the lower-triangular template"):
        n015.run_native_forward(cfg, impl, case, upstream=True)
    call = fia_calls[0]
    assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"]) == (4, WINDOW, 0)
    assert call["atten_mask"] is md.swa_mask


@pytest.mark.parametrize("state", list(STATES))
def test_sliding_layer_band_admits_129_keys_with_the_documented_template(cfg, fia_calls, state):
    """Calibration finding 2: the TND band is 129 keys where GPT-OSS attends 128 (docs/operators.md §3.4).

    Run the release's forward unmodified; up to 0.18.0 with the metadata's ``swa_mask`` replaced by its
    ``attn_mask`` - the documented template, i.e. exactly what upstream passes after PR #8387 (``sparse_mode=4``,
    ``pre_tokens=128``, ``next_tokens=0`` unchanged) - and on 0.19.1rc1 with its own metadata (it passes the
    template itself): the band is the same in every native release. By the documented band rule (OPD-fia2
    ``sparse_mode`` 4, right-down anchored; docs/operators.md §3.3) query row ``i`` of a batch with ``off = Skv - Sq`` attends
    ``i + off - 128 <= j <= i + off``: 129 keys. transformers' ``sliding_window_causal_mask_function(128)``
    allows ``q - 128 < k <= q``: 128 keys (the reference model, vLLM's GPU backends with
    ``window_size=(127, 0)``, and 0.15's own BSH decode path ``_forward_fia_slidingwindow`` keep 128).

    Asserted exactly as the docs predict: the native output equals the reference computed with window 129
    everywhere (<= 1e-5), equals the window-128 reference on every row at absolute position < 128 (<= 1e-5),
    and differs from it on every row at position >= 128 (> 1e-3; the smallest such difference seen is ~8e-3).
    """
    seqs = STATES[state]
    case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=5, sliding_window=WINDOW)
    md = _template_metadata(case.metadata)  # PR #8387's atten_mask
    sinks = _sinks()
    impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW, sinks=sinks, gpt_oss=False)
    out = n015.run_native_forward(cfg, impl, case, metadata=md, upstream=True)
    call = fia_calls[0]
    assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"], call["input_layout"]) == \
        (4, WINDOW, 0, "TND")
    assert call["atten_mask"] is md.attn_mask
    ref129 = reference_output(case, sinks=sinks, sliding_window=WINDOW + 1, scale=impl.scale)
    ref128 = reference_output(case, sinks=sinks, sliding_window=WINDOW, scale=impl.scale)
    assert (out - ref129).abs().max().item() <= 1e-5
    pos = _positions(seqs)
    row_diff = (out - ref128).abs().amax(dim=(1, 2))
    inside = pos < WINDOW
    assert inside.any() and (~inside).any()
    assert row_diff[inside].max().item() <= 1e-5
    assert row_diff[~inside].min().item() > 1e-3


def _sliding_window_null_blocks(context_len: int) -> list[int]:
    """Logical KV blocks that vLLM 0.15's scheduler has replaced by the null block when a request with
    ``context_len`` computed tokens decodes its next token: ``SlidingWindowManager`` (the KV-cache group of the
    sliding layers, ``SlidingWindowSpec`` from vLLM's ``Attention.get_kv_cache_spec``, docs/upstream.md §8.4)
    as ``KVCacheManager.allocate_slots`` drives it - prefill allocation, then ``remove_skipped_blocks(
    total_computed_tokens)`` and the allocation for the new token."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    pool = BlockPool(num_gpu_blocks=32, enable_caching=False, hash_block_size=n015.BLOCK_SIZE)
    spec = SlidingWindowSpec(block_size=n015.BLOCK_SIZE, num_kv_heads=KVN, head_size=D, dtype=torch.float32,
                             sliding_window=WINDOW)
    mgr = SlidingWindowManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=1)
    mgr.allocate_new_blocks("r", context_len, context_len)
    mgr.remove_skipped_blocks("r", context_len)
    mgr.allocate_new_blocks("r", context_len + 1, context_len + 1)
    blocks = mgr.req_to_blocks["r"]
    assert blocks[-1].block_id != pool.null_block.block_id and pool.null_block.block_id == n015.NULL_BLOCK
    return [i for i, b in enumerate(blocks) if b.is_null]


def test_sliding_layer_band_reads_vllms_null_block_as_the_129th_key(cfg):
    """Calibration finding 3 (consequence of finding 2 in a vLLM 0.15 deployment): the 129th key can be a zero.

    vLLM 0.15 keeps sliding layers in their own KV-cache group and its ``SlidingWindowManager`` frees every block
    whose tokens all lie before the window of the next query, ``get_num_skipped_tokens(p) = p - 128 + 1``
    (positions ``0 .. p-128``), replacing it in the block table by the null block (block 0; never written, and
    vllm-ascend 0.15.0rc1 ... 0.19.1rc1 allocate KV caches with ``torch.zeros``, ``_allocate_kv_cache_tensors``).
    The band's extra key ``p - 128`` is the last skipped position, so when it closes a block - decode position
    ``p ≡ 127 (mod 128)``, ``p >= 255`` - the operator reads K = V = 0 there:
    an extra ``exp(0 - m)`` in the softmax denominator, nothing in the numerator.

    With the documented template (as in finding 2) the native output equals the window-129 reference computed with
    key/value ``p - 128`` set to zero on exactly those rows (<= 1e-5), and the plain window-129 reference elsewhere.
    The block tables come from vLLM's own ``SlidingWindowManager``.
    """
    seqs = [(255, 1), (300, 1), (383, 1), (256, 1)]
    nulls = {c: _sliding_window_null_blocks(c) for c, _ in seqs}
    assert nulls == {255: [0], 300: [0], 383: [0, 1], 256: [0]}
    case = n015.build_case(cfg, seqs, num_heads=N, num_kv_heads=KVN, seed=9, sliding_window=WINDOW)
    table = case.metadata.block_tables.clone()
    for i, (c, _) in enumerate(seqs):
        table[i, nulls[c]] = n015.NULL_BLOCK
    md = _template_metadata(dataclasses.replace(case.metadata, block_tables=table))
    sinks = _sinks()
    impl = n015.make_impl(cfg, num_heads=N, num_kv_heads=KVN, sliding_window=WINDOW, sinks=sinks, gpt_oss=False)
    out = n015.run_native_forward(cfg, impl, case, metadata=md, upstream=True)

    zeroed = dataclasses.replace(case, full_k=[k.clone() for k in case.full_k], full_v=[v.clone() for v in case.full_v])
    hits = []
    for i, (c, _) in enumerate(seqs):
        extra = c - WINDOW  # the band's 129th key for the query at position c
        if extra // n015.BLOCK_SIZE in nulls[c]:
            zeroed.full_k[i][extra] = 0
            zeroed.full_v[i][extra] = 0
            hits.append(c)
    assert hits == [255, 383]
    want = reference_output(zeroed, sinks=sinks, sliding_window=WINDOW + 1, scale=impl.scale)
    assert (out - want).abs().max().item() <= 1e-5
    plain = reference_output(case, sinks=sinks, sliding_window=WINDOW + 1, scale=impl.scale)
    row_diff = (out - plain).abs().amax(dim=(1, 2))
    assert row_diff[[1, 3]].max().item() <= 1e-5 and row_diff[[0, 2]].min().item() > 1e-3


def test_the_harness_bring_up_loaded_the_atb_library_as_npu_worker_does(cfg):
    """``NPUWorker.__init__`` loads torch_npu's ATB operator library (0.15.0rc1 - 0.19.1rc1: unless on an Atlas A5);
    the native harness's bring-up (:func:`gptoss_patch.selftest.native.vllm_context`, run by the ``cfg`` fixture)
    did it too. The simulator counts the calls; nothing else in a test process makes one."""
    from gptoss_patch_testkit.npu_sim import runtime

    assert runtime.atb_registered() >= 1
