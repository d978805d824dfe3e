"""Issue 6 in a real cell: GPT-OSS attention under vllm-ascend's ACL graphs (PIECEWISE and FULL_DECODE_ONLY), in
every layout (0.11.0 B, 0.12.0rc1 C, 0.13.0 E, 0.14.0rc1 F).

What runs for real: vLLM's ``Attention`` layers (0.11: vllm-ascend's patched ``Attention.forward`` ->
``torch.ops.vllm.unified_ascend_attention_with_output`` -> ``AscendAttentionBackendImpl.forward``; 0.12.0rc1+:
vLLM's ``unified_attention_with_output`` -> ``forward`` -> ``forward_impl``),
``AscendAttentionMetadataBuilder.build`` / ``build_for_graph_capture``, ``acl_graph.ACLGraphWrapper`` (capture and
replay), ``set_graph_params`` / ``get_graph_params``, upstream's graph-parameter update for its own records (0.11
paged attention; 0.12.0rc1 ``full_graph_attention`` and 0.13+ ``full_graph_fia`` FIA records) through each release's
entry point (``update_attn_params`` with 3 / 4 arguments; 0.14.0rc1 ``update_full_graph_params`` ->
``AscendAttentionBackendImpl.update_graph_params``), ``set_forward_context``; the torch_npu operators and NPU graphs
are the simulator's. Ours in the loop (the role of ``NPUModelRunner``): persistent input buffers, one KV-cache group
per layer, the decode padding of each release's runner (``attention_case.DECODE_PADDING``), the step order
``replay -> update`` of ``_generate_process_reqs_hidden_states`` / ``_model_forward``.

Oracles: the same model run eagerly (``CUDAGraphMode.NONE``) on its own KV caches - equal exactly in float32 when
both use the same operator path - and transformers' GPT-OSS ``eager_attention_forward`` for the attention rows.

Deviations from the model runner, each for a reason stated where it happens: padded slot-mapping entries are -1
(the runner writes 0, i.e. every padded row writes block 0 slot 0, which the simulated ``_npu_reshape_and_cache``
rejects as the ATB operator's "no repeated slot" rule); ``weak_ref_tensors`` is an alias (vllm-ascend's compiled
``_C_ascend.weak_ref_tensor`` is not part of the simulator); ``numba`` is stubbed in the one subprocess that imports
``model_runner_v1`` (vLLM's n-gram proposer imports it; the cell venv does not install it).
"""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gptoss_patch.kernels import attention as kernels
from gptoss_patch.selftest import attention as attention_case
from gptoss_patch.selftest import graph as aclgraph_case
from gptoss_patch.selftest.graph import (BLOCK, KVN, MAX_BLOCKS, MAX_REQS, SCALE, SIZES, WINDOW, D, H,  # noqa: F401
                                                Harness, N, Toy, _config, _layer_name, batch_descriptor,
                                                runner_update)
from gptoss_patch.selftest.attention import build_case
from gptoss_patch_testkit.npu_sim import graph as G

import torch_npu  # noqa: E402,F401  (the simulated module, installed by conftest)

def attention_op(layout):
    """``(splitting-op name in compilation_config.splitting_ops, the op)``: vllm-ascend 0.11's own
    ``unified_ascend_attention_with_output``; from 0.12.0rc1 vLLM's ``unified_attention_with_output``."""
    import vllm.attention.layer  # noqa: F401 - registers vLLM's op
    import vllm_ascend.attention.attention_v1  # noqa: F401 - registers 0.11's op

    if attention_case.calls_forward_with_trace_flag(layout):
        return "vllm.unified_ascend_attention_with_output", torch.ops.vllm.unified_ascend_attention_with_output
    return "vllm::unified_attention_with_output", torch.ops.vllm.unified_attention_with_output


# ----------------------------------------------------------------------------------------------------------------
# fixtures


operator_path = attention_case.forced_path


@pytest.fixture()
def graph_env():
    """Fresh simulator graph state, no graph params, capturing allowed (:func:`aclgraph_case.graph_env`); yields
    vllm-ascend's ``acl_graph`` module."""
    with aclgraph_case.graph_env() as ag:
        yield ag


def transformers_decode(q, keys, values, *, sinks, window):
    """transformers' GPT-OSS ``eager_attention_forward`` for one decode query per sequence (float32).

    ``q`` ``(b, N, D)``; ``keys[i]``/``values[i]`` ``(L_i, KV_N, D)``; ``sinks`` ``(N,)`` or None (plain softmax:
    a sink of -inf); ``window``: keys ``j > pos - window`` (transformers ``sliding_window_causal_mask_function``)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    holder = torch.nn.Module()
    s = sinks.float() if sinks is not None else torch.full((N,), float("-inf"))
    holder.sinks = torch.nn.Parameter(s.clone(), requires_grad=False)
    holder.num_key_value_groups = N // KVN
    holder.eval()
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    outs = []
    for i in range(q.shape[0]):
        length = keys[i].shape[0]
        allowed = mask_fn(0, 0, torch.tensor([[length - 1]]), torch.arange(length).view(1, -1))
        additive = torch.zeros(1, length).masked_fill(~allowed, float("-inf")).view(1, 1, 1, length)
        out, _ = eager_attention_forward(holder, q[i].float().view(1, N, 1, D),
                                         keys[i].float().transpose(0, 1).unsqueeze(0),
                                         values[i].float().transpose(0, 1).unsqueeze(0), additive, scaling=SCALE)
        outs.append(out[0, 0])
    return torch.stack(outs)


def _batch_sizes(steps):
    """Batch sizes 1..8 in a fixed shuffled cycle: every capture size, padded (3, 5, 6, 7) and exact."""
    cycle = [3, 8, 1, 5, 2, 7, 4, 6, 8, 3, 1, 6, 5, 2, 7, 4]
    return [cycle[s % len(cycle)] for s in range(steps)]


def _active(step, b, num_reqs):
    return [(step * 3 + i) % num_reqs for i in range(b)]


# ----------------------------------------------------------------------------------------------------------------
# kernels: the .out variant and the padded decode lengths


def test_decode_launch_lengths_cover_each_releases_padding(layout):
    """3 decodes padded to 8 by the real builder / the runner's padding of this release: one launch of 8 rows, the
    real sequences' lengths kept, the padding rows KV length 0 - whatever the release left in the padding entries."""
    case = build_case([(129, 1), (300, 1), (5, 1)], num_heads=N, num_kv_heads=KVN, seed=1, pad_to=8)
    meta = case.metadata
    padding = attention_case.DECODE_PADDING[layout]
    if padding == "builder":  # 0.11: query offsets arange(4, 8) - one entry short of the padding; seq_lens ones
        assert meta.actual_seq_lengths_q == [1, 2, 3, 4, 5, 6, 7]
        assert meta.seq_lens_list == [130, 301, 6, 1, 1, 1, 1, 1]
    elif padding == "runner":  # 0.13+: host offsets arange, seq_lens zeros
        assert meta.actual_seq_lengths_q == [1, 2, 3, 4, 5, 6, 7, 8]
        assert meta.seq_lens_list == [130, 301, 6, 0, 0, 0, 0, 0]
    else:  # 0.12.0rc1: 8 requests, the host entries of the padding ones stale (here: an earlier mixed step's)
        assert meta.actual_seq_lengths_q[:3] == [1, 2, 3] and len(meta.actual_seq_lengths_q) == 8
        assert meta.actual_seq_lengths_q[3:] != [4, 5, 6, 7, 8] and min(meta.seq_lens_list[3:]) > 0
    assert meta.num_actual_tokens == 3
    q, kv = kernels.decode_launch_lengths(meta.actual_seq_lengths_q, meta.seq_lens_list, meta.num_actual_tokens, 8)
    assert q == [1, 2, 3, 4, 5, 6, 7, 8] and kv == [130, 301, 6, 0, 0, 0, 0, 0]
    # pad 1 (0.11: the builder adds no offset at all)
    case = build_case([(7, 1), (9, 1), (5, 1)], num_heads=N, num_kv_heads=KVN, seed=1, pad_to=4)
    meta = case.metadata
    q, kv = kernels.decode_launch_lengths(meta.actual_seq_lengths_q, meta.seq_lens_list, 3, 4)
    assert q == [1, 2, 3, 4] and kv == [8, 10, 6, 0]
    with pytest.raises(ValueError, match="exceed"):
        kernels.decode_launch_lengths([1, 2], [5, 5], 2, 1)
    with pytest.raises(ValueError, match="do not reach"):
        kernels.decode_launch_lengths([1, 2], [5, 5], 3, 4)


@pytest.mark.parametrize("path", ["v2", "lse"])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_out_variant_equals_eager_kernel_on_padded_batch(path, window):
    case = build_case([(127, 1), (128, 1), (300, 1)], num_heads=N, num_kv_heads=KVN, seed=4, pad_to=8)
    sinks = torch.randn(N, generator=torch.Generator().manual_seed(3)) * 2
    meta = case.metadata
    q = case.query.view(-1, N, D)
    with operator_path(path):
        assert kernels.graph_path(True) == path  # forced paths hold for graphs too
        qc, kv = kernels.decode_launch_lengths(meta.actual_seq_lengths_q, meta.seq_lens_list, 3, 8)
        eager = torch.full((8, N, D), float("nan"))
        kernels.sink_window_attention(q, case.key_cache, case.value_cache, block_table=meta.block_tables,
                                      query_cu_lens=qc, kv_lens=kv, num_heads=N, num_kv_heads=KVN, scale=SCALE,
                                      sinks=sinks, sliding_window=window, out=eager)
        real = torch.full((3, N, D), float("nan"))  # the real sequences alone
        kernels.sink_window_attention(q[:3], case.key_cache, case.value_cache, block_table=meta.block_tables[:3],
                                      query_cu_lens=[1, 2, 3], kv_lens=meta.seq_lens_list[:3], num_heads=N,
                                      num_kv_heads=KVN, scale=SCALE, sinks=sinks, sliding_window=window, out=real)
        out = torch.full((8, N, D), float("nan"))
        lse = torch.empty(8, N, 1) if path == "lse" else torch.empty(1)
        ws = kernels.max_workspace(path, q, case.key_cache, case.value_cache, block_table=meta.block_tables,
                                   query_cu_lens=qc, kv_lens=kv, num_heads=N, num_kv_heads=KVN, scale=SCALE,
                                   sinks=sinks, sliding_window=window)
        # the launch capture_decode makes (and every update re-issues): paged views, fia_kwargs, one .out launch,
        # the rescale after the group on the lse path
        key, value, block_size = kernels.paged_views(case.key_cache, case.value_cache)
        launch = kernels.fia_kwargs(path, block_table=meta.block_tables, block_size=block_size, query_cu_lens=qc,
                                    kv_lens=kv, num_heads=N, num_kv_heads=KVN, scale=SCALE, sinks=sinks,
                                    sliding_window=window, mask=kernels.causal_template(torch.int8, q.device))
        ret = kernels.relaunch_out(path, launch, q, key, value, out=out, softmax_lse=lse, workspace=ws)
        if path == "lse":
            kernels.sink_rescale_(out, lse, sinks)
    assert ret is out
    assert torch.equal(out, eager)  # same launch: identical, padding rows included
    assert torch.equal(out[3:], torch.zeros(5, N, D))  # padding rows: KV length 0 -> zero rows
    # the same attention as the real rows alone (the LSE path's rescale rounds per tensor size: 1e-6)
    assert (out[:3] - real).abs().max().item() <= 1e-6


#: Operator path of a captured sink layer by default, per cell: the torch_npu each vllm-ascend release pins (matrix
#: ``Row.torch_npu``: 2.7.1 / 2.8.0 are on op-plugin 7.2.0, whose captured v2 cannot be updated - docs/operators.md §3.8;
#: 2.9.0 is on 7.3.0, which can).
DEFAULT_GRAPH_PATH = {"0.11.0": "lse", "0.12.0rc1": "lse", "0.13.0": "lse", "0.14.0rc1": "v2"}


@pytest.fixture()
def pinned_torch_npu(cell, monkeypatch):
    """The simulated ``torch_npu`` reporting the version this cell's vllm-ascend pins (``matrix.Row.torch_npu``)."""
    import torch_npu as tn

    from gptoss_patch import matrix

    row = next(r for r in matrix.ROWS if r.vllm_ascend == cell)
    monkeypatch.setattr(tn, "__version__", f"{row.torch_npu}+gptoss.sim")
    return row.torch_npu


def test_graph_path_for_the_cells_torch_npu(cell, pinned_torch_npu):
    """Eagerly a sink layer always runs v2 (learnable_sink); captured, it runs v2 only where the pinned torch_npu can
    update a captured v2 (>= 2.9.0: vllm-ascend 0.14.0rc1), else v1 .out + LSE - unless v2 is forced."""
    import torch_npu as tn

    expected = DEFAULT_GRAPH_PATH[cell]
    assert kernels.v2_graph_update_supported(tn) == (expected == "v2")
    with operator_path(None):
        assert kernels.chosen_path() == "v2"
        assert kernels.graph_path(True) == expected
        assert kernels.graph_path(False) == "lse"  # no sinks: nothing to pass as learnable_sink
    with operator_path("v2"):
        assert kernels.graph_path(True) == "v2"
    with operator_path("lse"):
        assert kernels.graph_path(True) == "lse"


# ----------------------------------------------------------------------------------------------------------------
# PIECEWISE


def test_piecewise_config_splits_at_the_attention_op(tmp_path, layout):
    """NPUPlatform.check_and_update_config puts the attention op (0.11: vllm-ascend's own; 0.12.0rc1+: vLLM's, via
    ``set_splitting_ops_for_v1``) in splitting_ops for PIECEWISE (so attention runs between captured pieces) and
    clears the list for FULL_DECODE_ONLY."""
    from gptoss_patch.selftest import tiny
    from gptoss_patch.selftest import worker as vllm_setup

    tiny.config_for("tiny").save_pretrained(tmp_path)
    op, _ = attention_op(layout)
    pw = vllm_setup.engine_config(tmp_path, enforce_eager=False,
                                  compilation_config={"level": 3, "cudagraph_mode": "PIECEWISE"})
    assert pw.compilation_config.cudagraph_mode.name == "PIECEWISE"
    assert op in pw.compilation_config.splitting_ops
    assert not pw.compilation_config.cudagraph_mode.has_full_cudagraphs()
    full = vllm_setup.engine_config(tmp_path, enforce_eager=False,
                                    compilation_config={"level": 3, "cudagraph_mode": "FULL_DECODE_ONLY"})
    assert full.compilation_config.cudagraph_mode.has_full_cudagraphs()
    assert op not in full.compilation_config.splitting_ops


class _OpLog(TorchDispatchMode):
    """Names of the ATen / custom operators dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_piecewise_pieces_replay_around_eager_attention(graph_env, layout):
    """Pieces split at the attention op (:func:`attention_op`, as vLLM's split graph does): each piece is an
    ACLGraphWrapper(PIECEWISE) graph that allocates the attention output buffer; the splitting op runs eagerly and
    writes into it; the next piece reads it. 30 decode steps across the window and a block boundary == eager."""
    from vllm.config import CUDAGraphMode
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    kinds = ["sliding", "full", "plain"]
    _, split_op = attention_op(layout)
    hz = Harness(kinds, init_lens=(110, 126, 127, 250), offsets=[0, 5, 9], sizes=(4,))
    wts = hz.graph_model.weights

    def piece(i):
        def run(h, a):
            if a is not None:
                h = h + a.view(-1, H) @ wts[i - 1][3]
            if i == len(kinds):
                return (h,)
            wq, wk, wv, _ = wts[i]
            out = torch.empty(h.shape[0], N, D)  # Attention.forward's buffer, inside the compiled piece
            return h, (h @ wq).view(-1, N, D), (h @ wk).view(-1, KVN, D), (h @ wv).view(-1, KVN, D), out
        return run

    pieces = [ACLGraphWrapper(piece(i), hz.cfg_g, runtime_mode=CUDAGraphMode.PIECEWISE)
              for i in range(len(kinds) + 1)]

    def forward(x):
        h, a = x, None
        attn_outs = []
        for i, p in enumerate(pieces):
            res = p(h, a)
            if i == len(kinds):
                return res[0], attn_outs
            h, q, k, v, out = res
            split_op(q, k, v, out, _layer_name(i))  # the splitting op
            attn_outs.append(out)
            a = out

    size = 4
    with torch.inference_mode():
        # capture: upstream's PIECEWISE dummy run has no attention metadata (attention writes zeros)
        for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
            with hz.context(hz.cfg_g, None, mode, size):
                forward(hz.x[:size])
        assert all(len(p.concrete_aclgraph_entries) == 1 for p in pieces)
        bufs = None
        for step in range(30):
            b = 3 if step % 2 else 4
            active = _active(step, b, hz.num_reqs)
            hz.x[:b] = torch.randn(b, H)
            hz.x[b:size] = 0
            meta = hz.step_metadata(active, size)
            log = _OpLog()
            with hz.context(hz.cfg_g, meta, CUDAGraphMode.PIECEWISE, size), (log if step == 0 else
                                                                                 contextlib.nullcontext()):
                h_g, attn_g = forward(hz.x[:size])
            if step == 0:
                assert log.names.count(str(split_op.default)) == len(kinds)
            if bufs is None:
                bufs = [a.data_ptr() for a in attn_g]
            assert [a.data_ptr() for a in attn_g] == bufs  # written in place: the pieces' own buffers
            with hz.context(hz.cfg_e, meta, CUDAGraphMode.NONE, size):
                h_e, *attn_e = hz.eager_model(hz.x[:size])
            for a_g, a_e in zip(attn_g, attn_e):
                assert torch.equal(a_g.reshape(size, -1)[:b], a_e[:b])
            assert torch.equal(h_g[:b], h_e[:b])
    assert max(hz.groups[0].lengths) > 2 * BLOCK and min(hz.groups[0].lengths) < WINDOW + 40


def test_sink_window_attention_is_capture_safe(graph_env):
    """Our eager attention (used between PIECEWISE pieces) captured whole: no host read of device data is baked
    into the program (no host sync), and replays with new tensor contents equal eager - nothing escapes the buffers
    a replay reuses. (Its lengths are host lists; in PIECEWISE they are fresh each step because attention is not in
    a graph.)"""
    from vllm.config import CUDAGraphMode

    hz = Harness(["sliding", "full"], init_lens=(127, 128, 300), offsets=[0, 0], sizes=(4,))
    meta = hz.step_metadata([0, 1, 2], 4)
    with operator_path("v2"), torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.NONE, 4):
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g):
            outs = hz.graph_model(hz.x[:4])
        assert g.sim_host_reads == []
        assert "npu_fused_infer_attention_score_v2" in g.sim_recorded_ops
        for _ in range(3):
            hz.x[:3] = torch.randn(3, H)
            g.replay()
            torch.npu.synchronize()
            with hz.context(hz.cfg_e, meta, CUDAGraphMode.NONE, 4):
                for grp in hz.groups:  # the graph rewrote the same new token: make the eager caches match
                    grp.kc_e.copy_(grp.kc)
                    grp.vc_e.copy_(grp.vc)
                ref = hz.eager_model(hz.x[:4])
            for a, r in zip(outs, ref):
                assert torch.equal(a[:3], r[:3])


# ----------------------------------------------------------------------------------------------------------------
# FULL_DECODE_ONLY


MIXED = ["sliding", "full", "plain", "sliding", "full", "window", "plain"]

#: Length of the tuple upstream records for a plain layer in a FULL_DECODE_ONLY capture (docs/upstream.md §7.3):
#: 0.11 ``_forward_decode_only`` paged attention (9); 0.12.0rc1 ``full_graph_attention`` and 0.13+ ``full_graph_fia``
#: FIA (13; 0.13+ take ``full_graph_pa``, 9, only for a size in ``additional_config.pa_shape_list``, not set here).
UPSTREAM_RECORD_LEN = {"B": 9, "C": 13, "E": 13, "F": 13}


def _check_records(ag, hz):
    from gptoss_patch.patches.attention_graph.capture import GptOssAttnParams, UpstreamAttnParams

    gp = ag.get_graph_params()
    for size in hz.sizes:
        recs = gp.attn_params[size]
        assert [r.layer_name for r in recs] == [_layer_name(i) for i in range(len(hz.kinds))]
        assert [type(r) for r in recs] == [UpstreamAttnParams if k == "plain" else GptOssAttnParams
                                           for k in hz.kinds]
        assert len(gp.events[size]) == len(gp.handles[size]) == len(recs)
        for r, k in zip(recs, hz.kinds):
            if k != "plain":
                assert r.capture_size == size and r.query_cu_lens == list(range(1, size + 1))
                assert r.sliding_window == (None if k == "full" else WINDOW)
                assert (r.sinks is None) == (k == "window") and r.block_table.shape[0] == size
            else:
                assert len(r) == UPSTREAM_RECORD_LEN[hz.layout]  # still upstream's tuple
    return gp


#: Decode steps of the FULL_DECODE_ONLY replay test: 32 by default - two cycles of :func:`_batch_sizes` (every capture
#: size, 16 padded batches), and with the harness's initial lengths (1 ... 255 per group, + 37 per group) requests
#: cross the 128-key window and the 128 / 256-token block edges within them; the 200-step run is the soak variant
#: (``nox -s soak``, marker ``soak``).
REPLAY_STEPS = [32, pytest.param(200, marks=pytest.mark.soak, id="soak200")]


@pytest.mark.parametrize("steps", REPLAY_STEPS)
@pytest.mark.parametrize("path", ["v2", "lse"])
def test_full_decode_only_steps_equal_eager(graph_env, path, steps):
    """Capture at 1, 2, 4, 8 with GPT-OSS (sinks, sliding/full), a window-only layer and plain (upstream paged
    attention) layers in one graph, each layer its own sequence lengths; ``steps`` decode steps (32; 200 in the
    soak run) with lengths crossing the 128 window and 128-token blocks, batches padded up to the capture size;
    every step's output == eager exactly (float32), attention rows == transformers within 1e-5 (every 8th step)."""
    ag = graph_env
    with operator_path(path):
        hz = Harness(MIXED)
        start = [list(g.lengths) for g in hz.groups]
        hz.capture()
        gp = _check_records(ag, hz)
        assert {r.path for r in gp.attn_params[8] if hasattr(r, "path") and r.sinks is not None} == {path}
        seen_sizes, padded = set(), 0
        for step, b in enumerate(_batch_sizes(steps)):
            active = _active(step, b, hz.num_reqs)
            b, size, outs_g, outs_e, meta = hz.step(active)
            seen_sizes.add(size)
            padded += size > b
            for i, (og, oe) in enumerate(zip(outs_g, outs_e)):
                assert torch.equal(og[:b], oe[:b]), f"step {step}, output {i}: graph != eager"
            if step % 8 == 0:
                for i, kind in enumerate(hz.kinds):
                    kv = [hz.keys_values(i, r) for r in active]
                    ref = transformers_decode(hz.eager_model.queries[i][:b].view(b, N, D), [k for k, _ in kv],
                                              [v for _, v in kv],
                                              sinks=None if kind in ("plain", "window") else hz.sinks[i],
                                              window=WINDOW if kind in ("sliding", "window") else None)
                    err = (outs_g[i + 1][:b].view(b, N, D) - ref).abs().max().item()
                    assert err <= 1e-5, f"step {step} layer {i} ({kind}): {err}"
        assert seen_sizes == set(SIZES) and padded >= steps // 2
        lens = hz.groups[0].lengths
        assert min(lens) < WINDOW < max(lens) and max(lens) > 2 * BLOCK
        # crossed during the replays, not only before them: a sliding layer's request went from inside the window to
        # beyond it, and a request of every kind of GPT-OSS layer from one KV block into a new one
        crossed_window = {k for k, g, before in zip(hz.kinds, hz.groups, start)
                          if any(a < WINDOW < b for a, b in zip(before, g.lengths))}
        crossed_block = {k for k, g, before in zip(hz.kinds, hz.groups, start)
                         if any((a - 1) // BLOCK != (b - 1) // BLOCK for a, b in zip(before, g.lengths))}
        assert "sliding" in crossed_window, crossed_window
        assert {"sliding", "full", "window"} <= crossed_block, crossed_block
        ours = [r for r in gp.attn_params[8] if hasattr(r, "updates")]
        assert all(r.updates > 0 for r in ours)


def test_full_decode_only_default_path_within_rounding(graph_env, cell, pinned_torch_npu):
    """Default selection on the cell's pinned torch_npu: eager v2; captured v1 .out + LSE rescale (2.7.1 / 2.8.0) -
    the same attention up to float32 rounding - or v2 .out (2.9.0)."""
    with operator_path(None):
        hz = Harness(["sliding", "full", "plain"])
        hz.capture()
        paths = {r.path for r in graph_env.get_graph_params().attn_params[2] if hasattr(r, "path")}
        assert paths == {DEFAULT_GRAPH_PATH[cell]}
        for step, b in enumerate(_batch_sizes(16)):
            b, size, outs_g, outs_e, _ = hz.step(_active(step, b, hz.num_reqs))
            for og, oe in zip(outs_g, outs_e):
                assert (og[:b] - oe[:b]).abs().max().item() <= 1e-5


def test_update_pairs_records_by_layer_name(graph_env):
    """Upstream's positional zip over all metadata keys would give the plain layer's record (upstream's only one)
    layer 0's metadata; with per-layer lengths that differs. Ours pairs by name: every output == eager."""
    from gptoss_patch.patches.attention_graph.capture import GptOssAttnParams

    ag = graph_env
    with operator_path("lse"):
        hz = Harness(["sliding", "full", "plain"], offsets=[0, 300, 150])
        hz.capture()
        gp = ag.get_graph_params()
        assert gp.attn_params[4][2].layer_name == _layer_name(2)
        upstream_only = [r for r in gp.attn_params[4] if type(r) is not GptOssAttnParams]
        positional_key = list(hz.dummy_metadata(4))[0]  # upstream's zip: its first record <-> the first key
        assert len(upstream_only) == 1 and positional_key != upstream_only[0].layer_name
        for step in range(4):
            b, size, outs_g, outs_e, meta = hz.step(_active(step, 3, hz.num_reqs))
            assert meta[_layer_name(2)].seq_lens_list[:b] != meta[_layer_name(0)].seq_lens_list[:b]
            for og, oe in zip(outs_g, outs_e):
                assert torch.equal(og[:b], oe[:b])


def test_update_issues_no_tensor_work_and_reuses_captured_buffers(graph_env):
    """Our update: host lists only - no ATen op (no allocation, no copy, no host read) - and each launch passes the
    captured query/output/LSE/workspace again (the op-plugin doc order update -> replay is used here, so no replay
    work runs inside the timed call)."""
    from vllm.config import CUDAGraphMode

    ag = graph_env
    with operator_path("lse"):
        hz = Harness(["sliding", "full"], sizes=(2,))
        hz.capture()
        rec = ag.get_graph_params().attn_params[2][0]
        ptrs = [t.data_ptr() for t in (rec.query, rec.output, rec.softmax_lse, rec.workspace)]
        meta = hz.step_metadata([0, 1], 2)
        with torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.FULL, 2) as fc:
            log = _OpLog()
            with log:
                hz.update(fc, 2)
            assert log.names == []
            hz.wrapper(hz.x[:2])  # replay after the update (op-plugin doc order): nothing waits
            assert not hz.wrapper.concrete_aclgraph_entries[fc.batch_descriptor].aclgraph.sim_pending
        assert [t.data_ptr() for t in (rec.query, rec.output, rec.softmax_lse, rec.workspace)] == ptrs
        assert rec.seq_lens == [hz.groups[0].lengths[0], hz.groups[0].lengths[1]] and rec.updates == 1


def test_forced_update_failures_name_layer_and_size(graph_env, monkeypatch):
    from vllm.config import CUDAGraphMode

    from gptoss_patch.patches.attention_graph.capture import AclGraphUpdateError

    hz = Harness(["sliding", "plain", "full"], sizes=(4,))
    hz.capture()
    meta = hz.step_metadata([0, 1, 2], 4)
    del meta[_layer_name(2)]
    with torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.FULL, 4) as fc:
        with pytest.raises(AclGraphUpdateError) as err:
            hz.update(fc, 4)
    msg = str(err.value)
    assert err.value.layer_name == _layer_name(2) and err.value.capture_size == 4
    assert _layer_name(2) in msg and "capture size 4" in msg
    assert "PIECEWISE" in msg and "cudagraph_mode" in msg and "--enforce-eager" in msg and "stale" in msg

    # the operator rejects the re-issued launch
    G.reset_state()
    meta = hz.step_metadata([0, 1, 2], 4)
    real = torch_npu.npu_fused_infer_attention_score.out

    def refuse(*args, **kwargs):  # ours only (upstream's FIA records of 0.12+ never pass pre_tokens)
        if G._update is not None and "pre_tokens" in kwargs:
            raise RuntimeError("aclmdlRICaptureTaskUpdateBegin failed (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_npu.npu_fused_infer_attention_score, "out", refuse)
    with torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.FULL, 4) as fc:
        with pytest.raises(AclGraphUpdateError, match=r"model\.layers\.0\.self_attn\.attn.*capture size 4.*"
                                                      r"aclmdlRICaptureTaskUpdateBegin failed.*PIECEWISE"):
            hz.update(fc, 4)

    # a sequence outgrowing the captured block table
    G.reset_state()
    monkeypatch.undo()
    meta = hz.step_metadata([0, 1, 2], 4)
    meta[_layer_name(0)].seq_lens_list[0] = MAX_BLOCKS * BLOCK + 1
    with torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.FULL, 4) as fc:
        with pytest.raises(AclGraphUpdateError, match="exceeds the captured block table"):
            hz.update(fc, 4)


def test_capture_of_non_decode_batch_is_refused(graph_env):
    from vllm.config import CUDAGraphMode
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    from gptoss_patch.patches.attention_graph.capture import AclGraphCaptureError

    hz = Harness(["sliding"], sizes=(2,))
    from vllm_ascend.compilation.acl_graph import set_graph_params

    set_graph_params({2})
    meta = hz.dummy_metadata(2)
    meta[_layer_name(0)].attn_state = AscendAttentionState.ChunkedPrefill
    with torch.inference_mode(), hz.context(hz.cfg_g, meta, CUDAGraphMode.FULL, 2):
        with pytest.raises(AclGraphCaptureError, match="ChunkedPrefill.*PIECEWISE"):
            hz.wrapper(hz.x[:2])


# ----------------------------------------------------------------------------------------------------------------
# the patch as activated: status, and the by-value name in the model runner


#: Where each release's update must be our wrapper (docs/upstream.md §7.3, §7.5): the update function and every
#: module that imported it by value - 0.14.0rc1 dispatches through the impl class's staticmethod instead.
_AG = "vllm_ascend.compilation.acl_graph:update_attn_params"
_MR = "vllm_ascend.worker.model_runner_v1.update_attn_params"
EXPECTED_UPDATE_PLACES = {
    "B": {_AG, _MR},
    "C": {_AG, _MR},
    "E": {_AG, _MR, "vllm_ascend.spec_decode.eagle_proposer.update_attn_params"},
    "F": {"vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.update_graph_params"},
}


@pytest.fixture(scope="module")
def runner_child():
    """A fresh interpreter (activation through the installed .pth only) that imports the real model runner (and
    the EAGLE proposer, which 0.13 binds the update into too)."""
    import json

    from conftest import run_python

    code = textwrap.dedent("""
        import json
        from gptoss_patch_testkit.harness import importable_model_runner
        importable_model_runner()  # numba stub, worker patches without torchvision
        import vllm_ascend.worker.model_runner_v1 as mr
        import vllm_ascend.spec_decode.eagle_proposer
        import gptoss_patch
        from gptoss_patch.patches.attention_graph.update import is_patched, update_entry_points
        from gptoss_patch.selftest.attention import installed_layout

        def runner_calls():
            # what NPUModelRunner calls after a FULL replay: its module global update_attn_params (0.11 - 0.13), or
            # update_full_graph_params -> attn_backend.get_impl_cls().update_graph_params (0.14.0rc1)
            if hasattr(mr, "update_full_graph_params"):
                from vllm.config import VllmConfig, set_current_vllm_config
                from vllm_ascend.attention.attention_v1 import AscendAttentionBackend
                with set_current_vllm_config(VllmConfig()):  # get_impl_cls reads the parallel config
                    return AscendAttentionBackend.get_impl_cls().__dict__["update_graph_params"]
            return mr.update_attn_params

        layout = installed_layout()
        out = {"layout": layout, "state": {p.name: p.state for p in gptoss_patch.status().patches},
               "places": {w: is_patched(o) for w, o in update_entry_points(layout)},
               "runner_calls_patched": is_patched(runner_calls())}
        gptoss_patch.deactivate()
        out["after_deactivate"] = {"places": {w: is_patched(o) for w, o in update_entry_points(layout)},
                                   "runner_calls_patched": is_patched(runner_calls())}
        print("RESULT " + json.dumps(out))
    """)
    res = run_python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.xdist_group("runner_child")  # one child run per worker: keep both on one
def test_update_patch_applied_and_bound_in_model_runner(runner_child, layout):
    """The model runner calls the update through its own module global (0.11 - 0.13; also the 0.13 EAGLE proposer,
    docs/upstream.md §7.5) or through the impl's staticmethod (0.14.0rc1): in a real start-up it is our wrapper
    everywhere the release calls it."""
    from gptoss_patch import matrix

    assert runner_child["layout"] == layout
    names = [n for n in matrix.LAYOUT_PATCHES[layout] if n.startswith("attention_graph.")]
    assert len(names) == 1 and runner_child["state"][names[0]] == "applied", runner_child
    assert set(runner_child["places"]) == EXPECTED_UPDATE_PLACES[layout]
    assert all(runner_child["places"].values()), runner_child["places"]
    assert runner_child["runner_calls_patched"]


@pytest.mark.xdist_group("runner_child")  # one child run per worker: keep both on one
def test_deactivate_restores_model_runner_binding(runner_child):
    # model_runner_v1 binds update_attn_params by value *after* the patch applied (it imports acl_graph first):
    # Registry._rebind records such a binding too, so remove_all() restores it (0.14: the class attribute).
    after = runner_child["after_deactivate"]
    assert not any(after["places"].values()) and not after["runner_calls_patched"], after
