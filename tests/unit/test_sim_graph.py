"""NPU-simulator graph API: capture/replay, task-group updates, ExternalEvent ordering.

What is checked against what:

* replay == eager, bit for bit (float32), for captured programs mixing emulated ``torch_npu`` operators and plain
  torch code (linear, norms, views, in-place ops, factories, custom ``torch.library`` operators), after the
  inputs' *contents* change between replays;
* task-group updates change exactly the updated operator's launch arguments; wrong updates raise;
* ``ExternalEvent`` call orders (op-plugin 7.3.0 docs) and the two orders in which upstream drives the update
  (vllm-ascend: replay, then update + record; op-plugin doc example: update + record, then replay);
* the real vllm-ascend 0.11.0 capture branch (``_forward_decode_only``) and ``update_attn_params`` run on it.
"""

from __future__ import annotations

import types

import pytest
import torch

from gptoss_patch_testkit import npu_sim

npu_sim.install()

import torch_npu  # noqa: E402  (the simulated module)

from gptoss_patch_testkit.npu_sim import graph as G  # noqa: E402
from gptoss_patch_testkit.npu_sim._base import NotEmulated, NotEmulatedError  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated():
    G.reset_state()
    with torch.npu.stream(torch.npu.default_stream()):
        yield
    G.reset_state()


# ----------------------------------------------------------------------------------------------------------------
# tiny emulated operators of our own, routed like the npu_sim.ops ones


def _masked_rowsum(x, *, lengths, scale=1.0):
    """rows of x summed over their first lengths[i] columns (lengths is read on the host at launch)."""
    lens = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    idx = torch.arange(x.shape[1])
    mask = idx[None, :] < torch.tensor(lens)[:, None]
    return (x * mask).sum(dim=1) * scale


def _masked_rowsum_out(x, *, lengths, scale=1.0, out):
    out[0].copy_(_masked_rowsum(x, lengths=lengths, scale=scale))
    return out[0]


_masked_rowsum.out = _masked_rowsum_out
_masked_rowsum._npu_sim_host_params = ("lengths",)
masked_rowsum = G.route("sim_masked_rowsum", _masked_rowsum)


def _scale_add(x, y, *, alpha=1.0):
    return x * alpha + y


scale_add = G.route("sim_scale_add", _scale_add)


def _get_workspace(x):
    return torch.zeros(8, dtype=torch.uint8)


sim_get_workspace = G.route("_sim_get_workspace", _get_workspace)


# custom torch.library operators: a host-side python one (transparent), one that writes memory behind the
# dispatcher's back (recorded opaque), one whose kernel decides on the host (only correct when opaque)
_lib = torch.library.Library("gptoss_graph_test", "FRAGMENT")
_lib.define("affine(Tensor x, Tensor(a!) out) -> ()")
_lib.define("raw_double(Tensor x, Tensor(a!) out) -> ()")
_lib.define("pick_max_row(Tensor x) -> Tensor")


def _affine(x, out):
    out.copy_(x * 3.0 - 1.0)


def _raw_double(x, out):
    out.numpy()[...] = x.numpy() * 2.0  # no ATen call: invisible to a dispatch mode


def _pick_max_row(x):
    row = int(x.sum(dim=1).argmax())  # host-side decision
    return x[row].clone()


_lib.impl("affine", _affine, "CPU")
_lib.impl("raw_double", _raw_double, "CPU")
_lib.impl("pick_max_row", _pick_max_row, "CPU")


def _capture(fn):
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        result = fn()
    return g, result


# ----------------------------------------------------------------------------------------------------------------
# capture / replay


@pytest.mark.parametrize("inference", [True, False])
def test_replay_matches_eager_for_mixed_program(inference):
    torch.random.default_generator.manual_seed(0)  # torch.manual_seed also seeds the (simulated) npu module
    lin = torch.nn.Linear(16, 16)
    norm = torch.nn.RMSNorm(16)
    x = torch.randn(4, 16)
    y = torch.randn(4, 16)
    lengths = [16, 9, 3, 0]

    def forward():
        h = norm(lin(x))
        h = torch.nn.functional.silu(h) + torch.arange(16.0)  # factory op inside the graph
        z = scale_add(h, y, alpha=0.5)  # emulated, functional
        z = z.view(8, 8)[::2].contiguous()  # views + a copy kernel
        z.mul_(2.0).add_(1.0)  # in-place
        o = torch.empty(4)
        masked_rowsum.out(torch.cat([z, z], dim=1), lengths=lengths, out=[o])  # emulated, .out
        w = torch.empty(4, 16)
        torch.ops.gptoss_graph_test.affine(h, w)  # transparent custom op
        return o * 3, z, w.sum()

    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        g, (o_s, z_s, w_s) = _capture(forward)
        ptrs = [t.data_ptr() for t in (o_s, z_s, w_s)]
        assert "sim_scale_add" in g.sim_recorded_ops and "sim_masked_rowsum.out" in g.sim_recorded_ops
        assert not any("affine" in n for n in g.sim_recorded_ops)  # recorded as the kernels it launched
        for _ in range(3):
            x.copy_(torch.randn(4, 16))
            y.copy_(torch.randn(4, 16))
            lin.weight.mul_(1.01)  # parameters are inputs too
            g.replay()
            o_e, z_e, w_e = forward()
            assert torch.equal(o_s, o_e) and torch.equal(z_s, z_e) and torch.equal(w_s, w_e)
        assert [t.data_ptr() for t in (o_s, z_s, w_s)] == ptrs


def test_replay_matches_eager_for_a_whole_transformer_forward():
    """A whole model forward (embedding, rotary, GQA sdpa, RMSNorm, MLP, lm head) captured at the ATen level."""
    transformers = pytest.importorskip("transformers")
    torch.random.default_generator.manual_seed(2)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (2, 5))
    positions = torch.arange(5).expand(2, 5).contiguous()
    with torch.inference_mode():
        g, logits = _capture(lambda: model(input_ids=ids, position_ids=positions, use_cache=False).logits)
        assert g.sim_host_reads == []
        for _ in range(3):
            ids.copy_(torch.randint(0, 97, (2, 5)))
            positions.add_(1)
            g.replay()
            assert torch.equal(logits, model(input_ids=ids, position_ids=positions, use_cache=False).logits)


def test_replay_uses_captured_tensors_not_rebound_python_names():
    x = torch.randn(3)
    g, out = _capture(lambda: x * 2)
    x = torch.ones(3)  # a new tensor: the graph still reads the captured one
    old = out.clone()
    g.replay()
    assert torch.equal(out, old)


def test_custom_op_writing_behind_the_dispatcher_is_recorded_whole():
    x = torch.randn(5)
    out = torch.empty(5)
    g, _ = _capture(lambda: torch.ops.gptoss_graph_test.raw_double(x + 1, out))
    assert g.sim_recorded_ops == ["aten.add.Tensor", "gptoss_graph_test.raw_double.default"]
    x.copy_(torch.randn(5))
    g.replay()
    assert torch.equal(out, (x + 1) * 2)


def test_compiled_library_ops_are_opaque_so_device_side_decisions_stay_dynamic(monkeypatch):
    x = torch.randn(4, 3)
    monkeypatch.setattr(G, "OPAQUE_NAMESPACES", G.OPAQUE_NAMESPACES | {"gptoss_graph_test"})
    g, picked = _capture(lambda: torch.ops.gptoss_graph_test.pick_max_row(x))
    assert g.sim_recorded_ops == ["gptoss_graph_test.pick_max_row.default"]
    for _ in range(3):
        x.copy_(torch.randn(4, 3))
        g.replay()
        assert torch.equal(picked, x[int(x.sum(1).argmax())])


def test_transparent_custom_op_bakes_its_host_decisions():
    """A host-side custom op runs once at capture (as on the device); its .item() is listed as a baked host read."""
    x = torch.tensor([[0.0, 0.0], [5.0, 5.0], [1.0, 1.0]])
    g, picked = _capture(lambda: torch.ops.gptoss_graph_test.pick_max_row(x))
    assert {"aten.item.default", "aten._local_scalar_dense.default"} & set(g.sim_host_reads)
    x.copy_(torch.tensor([[9.0, 9.0], [0.0, 0.0], [1.0, 1.0]]))
    g.replay()
    assert torch.equal(picked, x[1])  # row chosen at capture time


def test_host_read_arguments_are_baked_at_launch():
    x = torch.randn(2, 6)
    lens_list = [6, 2]
    lens_tensor = torch.tensor([1, 5], dtype=torch.int32)
    g, (a, b) = _capture(lambda: (masked_rowsum(x, lengths=lens_list), masked_rowsum(x, lengths=lens_tensor)))
    lens_list[0] = 1  # host-side changes after the launch do not reach the captured task
    lens_tensor.fill_(6)
    x.copy_(torch.randn(2, 6))
    g.replay()
    assert torch.equal(a, _masked_rowsum(x, lengths=[6, 2]))
    assert torch.equal(b, _masked_rowsum(x, lengths=[1, 5]))


def test_host_only_ops_are_not_recorded():
    x = torch.randn(3)
    g, ws = _capture(lambda: (sim_get_workspace(x), x + 1)[0])
    assert g.sim_recorded_ops == ["aten.add.Tensor"]
    assert ws.dtype == torch.uint8


def test_data_dependent_shapes_cannot_replay():
    x = torch.tensor([1.0, 0.0, 2.0])
    g, _ = _capture(lambda: torch.nonzero(x))
    x.copy_(torch.tensor([1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="data-dependent output shapes"):
        g.replay()


def test_graph_lifecycle_errors():
    g = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="replay without a preceding successful capture"):
        g.replay()
    with pytest.raises(RuntimeError, match=r"pool\(\) without a preceding successful capture"):
        g.pool()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    pool = torch.npu.graph_pool_handle()
    s = torch.npu.Stream()
    with torch.npu.graph(g, pool=pool, stream=s):
        assert torch.npu.current_stream() == s
        assert torch.npu.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="synchroni"):
            torch.npu.synchronize()
        with pytest.raises(RuntimeError, match="one capture"):
            torch.npu.NPUGraph().capture_begin()
    assert torch.npu.current_stream() == torch.npu.default_stream()
    assert not torch.npu.is_current_stream_capturing()
    assert g.pool() == pool
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with torch.npu.graph(g):
            pass
    g.reset()
    with pytest.raises(RuntimeError, match="replay without"):
        g.replay()
    with pytest.raises(NotEmulatedError):
        torch.npu.graph(torch.npu.NPUGraph(), auto_dispatch_capture=True)
    with pytest.raises(NotEmulatedError):
        g.update([{}])
    with pytest.raises(TypeError):
        torch_npu._C._NPUTaskGroupHandle()
    assert isinstance(torch_npu.npu.graphs.NPUGraph, type) and not isinstance(torch.npu.make_graphed_callables,
                                                                               type)
    assert isinstance(torch.npu.make_graphed_callables, NotEmulated)


def test_capture_end_on_another_stream_raises():
    g = torch.npu.NPUGraph()
    s = torch.npu.Stream()
    with torch.npu.stream(s):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="same stream it began on"):
        g.capture_end()
    with torch.npu.stream(s):
        g.capture_end()


# ----------------------------------------------------------------------------------------------------------------
# task groups


def _grouped_program(x, lens_a, lens_b):
    """Two grouped launches (as vllm-ascend captures attention) plus plain ops depending on both."""
    a, b = torch.empty(x.shape[0]), torch.empty(x.shape[0])
    stream = torch.npu.current_stream()
    handles = []
    for out, lens in ((a, lens_a), (b, lens_b)):
        torch.npu.graph_task_group_begin(stream)
        masked_rowsum.out(x, lengths=lens, out=[out])
        handles.append(torch.npu.graph_task_group_end(stream))
    return a, b, a * 10 + b, handles


def test_task_group_update_changes_only_that_launch():
    x = torch.randn(3, 8)
    g, (a, b, c, (ha, hb)) = _capture(lambda: _grouped_program(x, [8, 4, 1], [2, 2, 2]))
    assert isinstance(ha, torch_npu._C._NPUTaskGroupHandle) and ha.task_group != hb.task_group
    upd = torch.npu.Stream()
    with torch.npu.stream(upd):
        torch.npu.graph_task_update_begin(upd, ha)
        ret = masked_rowsum.out(x, lengths=[1, 8, 5], out=[a])
        torch.npu.graph_task_update_end(upd)
    assert ret is a
    x.copy_(torch.randn(3, 8))
    g.replay()
    assert torch.equal(a, _masked_rowsum(x, lengths=[1, 8, 5]))
    assert torch.equal(b, _masked_rowsum(x, lengths=[2, 2, 2]))
    assert torch.equal(c, a * 10 + b)
    g.replay()  # updates persist
    assert torch.equal(a, _masked_rowsum(x, lengths=[1, 8, 5]))


def test_task_group_update_misuse_raises():
    x = torch.randn(2, 4)
    g, (a, _b, _c, (ha, _hb)) = _capture(lambda: _grouped_program(x, [4, 4], [1, 1]))
    upd = torch.npu.Stream()
    with torch.npu.stream(upd):
        torch.npu.graph_task_update_begin(upd, ha)
        with pytest.raises(RuntimeError, match="same kernel"):
            masked_rowsum(x, lengths=[1, 1])  # functional form: another kernel than the captured .out
        torch.npu.graph_task_update_begin(upd, ha)
        with pytest.raises(RuntimeError, match="same kernel"):
            scale_add(x, x)
        torch.npu.graph_task_update_begin(upd, ha)
        with pytest.raises(RuntimeError, match="0 task.*captured 1"):
            torch.npu.graph_task_update_end(upd)
        torch.npu.graph_task_update_begin(upd, ha)
        masked_rowsum.out(x, lengths=[1, 1], out=[a])
        with pytest.raises(RuntimeError, match="task 2 but the task group captured 1"):
            masked_rowsum.out(x, lengths=[1, 1], out=[a])
        torch.npu.graph_task_update_begin(upd, ha)
        with pytest.raises(RuntimeError, match="already open"):
            torch.npu.graph_task_update_begin(upd, ha)
        with pytest.raises(RuntimeError, match="same stream|the one passed"):
            torch.npu.graph_task_update_end(torch.npu.Stream())
        masked_rowsum.out(x, lengths=[2, 2], out=[a])
        torch.npu.graph_task_update_end(upd)
    with pytest.raises(RuntimeError, match="must differ"):
        torch.npu.graph_task_update_begin(G.graph.default_capture_stream, ha)
    with pytest.raises(RuntimeError, match="without a matching"):
        torch.npu.graph_task_update_end(upd)
    g.reset()
    with pytest.raises(RuntimeError, match="reset"):
        torch.npu.graph_task_update_begin(upd, ha)


def test_task_group_capture_misuse_raises():
    s = torch.npu.Stream()
    with pytest.raises(RuntimeError, match="not capturing"):
        torch.npu.graph_task_group_begin(s)
    with pytest.raises(RuntimeError, match="without a matching"):
        torch.npu.graph_task_group_end(s)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        with pytest.raises(RuntimeError, match="already open"):
            torch.npu.graph_task_group_begin(s)
        with pytest.raises(RuntimeError, match="inside a task group"):
            torch.npu.ExternalEvent().wait(s)
        with pytest.raises(RuntimeError, match="the one passed to graph_task_group_begin"):
            torch.npu.graph_task_group_end(torch.npu.Stream())
        torch.npu.graph_task_group_end(s)
    with pytest.raises(RuntimeError, match="without graph_task_group_end"):
        with torch.npu.graph(torch.npu.NPUGraph(), stream=s):
            torch.npu.graph_task_group_begin(s)


# ----------------------------------------------------------------------------------------------------------------
# ExternalEvent and the upstream update protocol


def _evented_capture(x, lens):
    """The vllm-ascend capture protocol around one launch: wait, reset, group(op); returns the launch's buffers."""
    event = torch.npu.ExternalEvent()
    out = torch.empty(x.shape[0])

    def body():
        stream = torch_npu.npu.current_stream()
        pre = x * 2  # work before the attention-like launch
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        masked_rowsum.out(pre, lengths=lens, out=[out])
        handle = torch.npu.graph_task_group_end(stream)
        return handle, pre, out + 1

    g, (handle, pre, post) = _capture(body)
    return g, event, handle, pre, out, post


def _update(event, handle, pre, lens, out, stream):
    """vllm-ascend's update: re-issue the launch on the update stream with the captured buffers, then record."""
    with torch.npu.stream(stream):
        torch.npu.graph_task_update_begin(stream, handle)
        masked_rowsum.out(pre, lengths=lens, out=[out])
        torch.npu.graph_task_update_end(stream)
        event.record(stream)


def test_vllm_ascend_order_replay_then_update():
    x = torch.randn(2, 5)
    g, event, handle, pre, out, post = _evented_capture(x, [5, 5])
    upd, host = torch.npu.Stream(), torch.npu.Stream()
    for lens in ([1, 2], [5, 3], [0, 4]):
        x.copy_(torch.randn(2, 5))
        stale = post.clone()
        g.replay()  # queued behind the captured event.wait
        assert g.sim_pending and not torch.npu.default_stream().query()
        with torch.npu.stream(host):  # look from another stream: the replay stopped before the launch
            assert torch.equal(post, stale) and torch.equal(pre, x * 2)
        _update(event, handle, pre, lens, out, upd)  # the record releases the graph
        assert not g.sim_pending and torch.npu.default_stream().query()
        assert torch.equal(out, _masked_rowsum(x * 2, lengths=lens)) and torch.equal(post, out + 1)


def test_op_plugin_doc_order_update_then_replay():
    x = torch.randn(2, 5)
    g, event, handle, pre, out, post = _evented_capture(x, [5, 5])
    _update(event, handle, pre, [3, 1], out, torch.npu.Stream())
    x.copy_(torch.randn(2, 5))
    g.replay()
    assert not g.sim_pending
    assert torch.equal(out, _masked_rowsum(x * 2, lengths=[3, 1]))


def test_update_may_rebind_tensor_arguments():
    """The update re-launches the kernel: a tensor passed there is what the replay reads (as on the device)."""
    x = torch.randn(2, 5)
    g, event, handle, pre, out, post = _evented_capture(x, [5, 5])
    other = torch.randn(2, 5)
    _update(event, handle, other, [5, 5], out, torch.npu.Stream())
    g.replay()
    assert torch.equal(out, _masked_rowsum(other, lengths=[5, 5]))


def test_missing_update_blocks_and_is_detected():
    x = torch.randn(2, 5)
    g, event, handle, pre, out, post = _evented_capture(x, [5, 5])
    g.replay()
    with pytest.raises(RuntimeError, match="would never return"):
        torch.npu.synchronize()
    with pytest.raises(RuntimeError, match="would never return"):
        torch.npu.default_stream().synchronize()
    with pytest.raises(RuntimeError, match="blocked"):
        post.sum()  # reads memory the queued graph still writes: a real NPU would order it after the graph
    with pytest.raises(RuntimeError, match="blocked"):
        scale_add(out, out)
    post.view(-1)  # metadata only
    torch.randn(3) * 2  # unrelated work is unaffected
    other = torch.npu.Stream()
    with torch.npu.stream(other):
        post.sum()  # another stream is not blocked (racy on a device, but not an ordering violation here)
    g.replay()  # queued behind the first replay on the same stream
    upd = torch.npu.Stream()
    _update(event, handle, pre, [1, 1], out, upd)
    assert g.sim_pending  # the first replay consumed the record; the second waits for the next one
    _update(event, handle, pre, [2, 2], out, upd)
    assert not g.sim_pending
    torch.npu.synchronize()
    assert torch.equal(out, _masked_rowsum(x * 2, lengths=[2, 2]))


def test_external_event_orders():
    s1, s2 = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    ev.wait(s1)  # wait -> reset -> record
    ev.reset(s1)
    assert not s1.query()
    ev.record(s2)
    assert s1.query()
    ev.record(s2)  # record -> wait -> reset
    ev.wait(s1)
    ev.reset(s1)
    ev.record(s2)
    with pytest.raises(RuntimeError, match="reset before reuse"):
        ev.record(s2)
    G.reset_state()
    ev2 = torch.npu.ExternalEvent()
    ev2.record(s2)
    with pytest.raises(RuntimeError, match="no wait consumed"):
        ev2.reset(s2)


def test_stream_and_event_follow_queued_graph_work():
    x = torch.randn(2, 5)
    g, event, handle, pre, out, post = _evented_capture(x, [5, 5])
    g.replay()
    s = torch.npu.Stream()
    s.wait_stream(torch.npu.default_stream())
    done = torch.npu.Event()
    done.record(torch.npu.default_stream())
    assert not s.query() and not done.query()
    with pytest.raises(RuntimeError, match="would never return"):
        done.synchronize()
    _update(event, handle, pre, [1, 1], out, torch.npu.Stream())
    assert s.query() and done.query()


# ----------------------------------------------------------------------------------------------------------------
# the real emulated attention operators


def _paged_setup(b=3, n=4, kvn=2, d=16, block=16, blocks=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(blocks, block, kvn, d, generator=gen)
    vc = torch.randn(blocks, block, kvn, d, generator=gen)
    bt = torch.randperm(blocks, generator=gen)[: b * 2].reshape(b, 2).to(torch.int32)
    q = torch.randn(b, n, d, generator=gen)
    return q, kc, vc, bt


def test_fia_out_update_of_kv_lengths():
    b, n, kvn, d, block = 3, 4, 2, 16, 16
    q, kc, vc, bt = _paged_setup(b, n, kvn, d, block)
    query = q.reshape(b, 1, n * d).contiguous()
    key, value = kc.flatten(2, 3).contiguous(), vc.flatten(2, 3).contiguous()
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", block_size=block, scale=d ** -0.5,
              block_table=bt, actual_seq_lengths=[1] * b)
    o, lse = torch.empty(b, 1, n * d), torch.empty(1)
    event = torch.npu.ExternalEvent()

    def body():
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        torch_npu.npu_fused_infer_attention_score.out(query, key, value, actual_seq_lengths_kv=[32, 32, 32],
                                                       out=[o, lse], **kw)
        return torch.npu.graph_task_group_end(s)

    g, handle = _capture(body)
    upd = torch.npu.Stream()
    for lens in ([5, 17, 32], [1, 1, 2]):
        query.copy_(torch.randn(b, 1, n * d))
        g.replay()
        with torch.npu.stream(upd):
            torch.npu.graph_task_update_begin(upd, handle)
            torch_npu.npu_fused_infer_attention_score.out(query, key, value, actual_seq_lengths_kv=lens,
                                                           out=[o, lse], **kw)
            torch.npu.graph_task_update_end(upd)
            event.record(upd)
        expected, _ = torch_npu.npu_fused_infer_attention_score(query, key, value, actual_seq_lengths_kv=lens, **kw)
        assert torch.equal(o, expected)


def test_decode_step_program_with_cache_write_and_attention():
    """A decode layer as FULL_DECODE_ONLY captures it: cache write, projections, grouped attention, residual."""
    torch.random.default_generator.manual_seed(1)  # torch.manual_seed also seeds the (simulated) npu module
    b, n, kvn, d, block, blocks = 2, 4, 2, 16, 16, 6
    hidden = n * d
    wq, wk, wv, wo = (torch.nn.Linear(hidden, out) for out in (n * d, kvn * d, kvn * d, hidden))
    norm = torch.nn.RMSNorm(hidden)
    kc, vc = torch.zeros(blocks, block, kvn, d), torch.zeros(blocks, block, kvn, d)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    x = torch.randn(b, hidden)  # static input buffer
    slots = torch.zeros(b, dtype=torch.int32)  # static slot mapping
    attn = torch.empty(b, n, d)
    event = torch.npu.ExternalEvent()

    def layer(seq_lens, capturing):
        h = norm(x)
        q, k, v = wq(h).view(b, n, d), wk(h).view(b, kvn, d), wv(h).view(b, kvn, d)
        torch_npu._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_indices=slots)
        if capturing:
            s = torch.npu.current_stream()
            event.wait(s)
            event.reset(s)
            torch.npu.graph_task_group_begin(s)
        torch_npu._npu_paged_attention(query=q, key_cache=kc, value_cache=vc, num_kv_heads=kvn, num_heads=n,
                                       scale_value=d ** -0.5, block_table=bt, context_lens=seq_lens, out=attn)
        handle = torch.npu.graph_task_group_end(s) if capturing else None
        return x + wo(attn.view(b, hidden)), q, handle

    with torch.inference_mode():
        # capture at position 0 of each sequence; the graph then serves every later step
        slots.copy_(torch.tensor([0, 2 * block], dtype=torch.int32))
        g, (y_s, q_s, handle) = _capture(lambda: layer(torch.tensor([1, 1], dtype=torch.int32), True))
        kc.zero_()
        vc.zero_()
        upd = torch.npu.Stream()
        kc_e, vc_e = kc.clone(), vc.clone()
        for step in range(4):
            new_x = torch.randn(b, hidden)
            lens = torch.tensor([step + 1, step + 1], dtype=torch.int32)
            new_slots = torch.tensor([step, 2 * block + step], dtype=torch.int32)
            # eager reference on separate caches
            kc_g, vc_g = kc, vc
            kc, vc = kc_e, vc_e
            x.copy_(new_x)
            slots.copy_(new_slots)
            y_e, _, _ = layer(lens, False)
            y_e = y_e.clone()
            kc, vc = kc_g, vc_g
            # graph step, vllm-ascend order: inputs, replay, update, record
            x.copy_(new_x)
            slots.copy_(new_slots)
            g.replay()
            with torch.npu.stream(upd):
                torch.npu.graph_task_update_begin(upd, handle)
                torch_npu._npu_paged_attention(query=q_s, key_cache=kc, value_cache=vc, num_kv_heads=kvn,
                                               num_heads=n, scale_value=d ** -0.5, block_table=bt,
                                               context_lens=lens, out=attn)
                torch.npu.graph_task_update_end(upd)
                event.record(upd)
            assert torch.equal(y_s, y_e)
            assert torch.equal(kc, kc_e) and torch.equal(vc, vc_e)


@pytest.mark.upstream
def test_vllm_ascend_0_11_paged_decode_capture_and_update_attn_params(monkeypatch):
    """vllm-ascend 0.11.0's own code: the capturing branch of _forward_decode_only and update_attn_params."""
    import vllm_ascend.attention.attention_v1 as av
    import vllm_ascend.compilation.acl_graph as ag
    # torch.ops._C_ascend.weak_ref_tensor (vllm-ascend's compiled library) is not part of the simulator;
    # an alias of the same tensor has the property the graph code relies on (same memory)
    monkeypatch.setattr(av, "weak_ref_tensors", lambda t: t)
    monkeypatch.setattr(ag, "_graph_params", None)
    b, n, kvn, d, block = 2, 4, 2, 16, 16
    ag.set_graph_params({b})
    forward_context = types.SimpleNamespace(capturing=True)
    monkeypatch.setattr(av, "get_forward_context", lambda: forward_context)
    layers = []
    for seed in (0, 1):
        q, kc, vc, bt = _paged_setup(b, n, kvn, d, block, seed=seed)
        layers.append(types.SimpleNamespace(sliding_window=None, key_cache=kc, value_cache=vc, num_kv_heads=kvn,
                                            num_heads=n, scale=d ** -0.5, head_size=d, block_tables=bt))
    query = torch.randn(b, n, d)
    outs = [torch.empty(b, n, d), torch.empty(b, n, d)]

    def model(seq_lens):
        h = query * 1.5
        for impl, out in zip(layers, outs):
            meta = types.SimpleNamespace(seq_lens=seq_lens, block_tables=impl.block_tables)
            av.AscendAttentionBackendImpl._forward_decode_only(impl, h, meta, out)
            h = out * 0.5 + h
        return h

    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        h_s = model(torch.tensor([32, 32], dtype=torch.int32))
    assert g.sim_recorded_ops.count("_npu_paged_attention") == 2
    update_stream = torch.npu.Stream()
    for lens in ([3, 30], [17, 1]):
        query.copy_(torch.randn(b, n, d))
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        g.replay()  # ACLGraphWrapper: replay ...
        fc = types.SimpleNamespace(attn_metadata={"l0": types.SimpleNamespace(seq_lens=seq_lens),
                                                  "l1": types.SimpleNamespace(seq_lens=seq_lens)})
        ag.update_attn_params(update_stream, fc, b)  # ... then NPUModelRunner updates (0.11.0 order)
        assert not g.sim_pending
        forward_context.capturing = False
        expected = torch.empty(b, n, d)
        h = query * 1.5
        for impl in layers:
            torch_npu._npu_paged_attention(query=h, key_cache=impl.key_cache, value_cache=impl.value_cache,
                                           num_kv_heads=kvn, num_heads=n, scale_value=d ** -0.5,
                                           block_table=impl.block_tables, context_lens=seq_lens, out=expected)
            h = expected * 0.5 + h
        assert torch.equal(h_s, h)


@pytest.mark.upstream
def test_vllm_ascend_0_11_sliding_window_decode_keeps_capture_time_lengths(monkeypatch):
    """Documents upstream behaviour the patch must handle: vllm-ascend 0.11.0 launches the sliding-window decode
    (``npu_fused_infer_attention_score``, BSH) outside any task group and never updates it, and its
    ``actual_seq_lengths_kv`` is read on the host at launch - so every replay uses the capture-time lengths."""
    import vllm_ascend.attention.attention_v1 as av

    monkeypatch.setattr(av, "get_forward_context", lambda: types.SimpleNamespace(capturing=True))
    b, n, kvn, d, block = 2, 4, 2, 16, 16
    q, kc, vc, bt = _paged_setup(b, n, kvn, d, block)
    impl = types.SimpleNamespace(sliding_window=8, key_cache=kc, value_cache=vc, num_kv_heads=kvn, num_heads=n,
                                 scale=d ** -0.5, head_size=d)
    seq_lens = torch.tensor([20, 20], dtype=torch.int32)  # the metadata tensor of the capture step
    meta = types.SimpleNamespace(seq_lens=seq_lens, block_tables=bt)
    g, out = _capture(lambda: av.AscendAttentionBackendImpl._forward_decode_only(impl, q, meta, None))
    assert g.sim_recorded_ops == ["npu_fused_infer_attention_score"]

    def reference(lens):
        o, _ = torch_npu.npu_fused_infer_attention_score(
            q.view(b, 1, n * d), kc.flatten(2, 3), vc.flatten(2, 3), num_heads=n, num_key_value_heads=kvn,
            input_layout="BSH", block_size=block, pre_tokens=8, scale=d ** -0.5, block_table=bt,
            actual_seq_lengths=[1] * b, actual_seq_lengths_kv=lens)
        return o.view(b, n, d)

    seq_lens.copy_(torch.tensor([25, 9], dtype=torch.int32))  # even an in-place change does not reach the graph
    q.copy_(torch.randn(b, n, d))
    g.replay()
    assert torch.equal(out, reference([20, 20]))
    assert not torch.equal(out, reference([25, 9]))


def test_blocked_stream_during_capture_unwinds_dispatch_modes():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    base = len(_get_current_dispatch_mode_stack())
    x = torch.randn(3)
    side, ev = torch.npu.Stream(), torch.npu.ExternalEvent()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        ev.wait(side)  # eager: `side` is not the capture stream; it blocks, pushing the guard above the recorder
        y = x + 1
    assert len(_get_current_dispatch_mode_stack()) == base + 1  # only the guard is left
    ev.record(torch.npu.Stream())
    assert side.query() and len(_get_current_dispatch_mode_stack()) == base
    x.copy_(torch.randn(3))
    g.replay()
    assert torch.equal(y, x + 1)
