"""ACL graph: capture GPT-OSS decode attention as an updatable task and re-issue it with each step's lengths.

Why
    Graph mode is where decode speed is (vllm-ascend PR #4467: TPOT 79 ms eager -> 20 ms PIECEWISE). In
    FULL_DECODE_ONLY mode vllm-ascend 0.11.x captures the whole decode forward once per capture size; the decode
    attention's host parameters (sequence lengths) are rewritten before every replay by
    ``vllm_ascend.compilation.acl_graph.update_attn_params``, which knows only the plain ``_npu_paged_attention``
    record (no sinks, no window; docs/upstream.md §7.3). GPT-OSS layers run our fused operator
    (:mod:`gptoss_patch.patches.attention`), whose lengths are read on the host at launch: captured without a task
    group they would be frozen at capture time and every replay would attend the wrong keys - exactly what
    upstream's own sliding-window decode does in 0.11.0 (``_forward_decode_only`` launches a BSH
    ``npu_fused_infer_attention_score`` during capture outside any task group; its ``actual_seq_lengths_kv`` stay
    those of the capture; shown by ``tests/unit/test_sim_graph.py``).
How
    *Capture* (:func:`capture_decode`, called by ``attention.sink_window_attend`` when ``forward_context.capturing``
    and the current stream is capturing): upstream's protocol - ``ExternalEvent`` wait + reset on the capture stream,
    ``graph_task_group_begin``, ONE ``.out`` launch of the fused operator
    (:func:`gptoss_patch.kernels.attention.relaunch_out`: v2 with ``learnable_sink``, or v1 with
    ``softmax_lse_flag`` whose :func:`~gptoss_patch.kernels.attention.sink_rescale_` follows outside the group),
    ``graph_task_group_end`` - into the captured output buffer, with a preallocated LSE and a workspace from
    ``_npu_fused_infer_attention_score(_v2)_get_max_workspace`` cached per capture size (and geometry). Padded
    decode batches are covered row for row (:func:`~gptoss_patch.kernels.attention.decode_launch_lengths`). A typed
    :class:`GptOssAttnParams` is appended to ``get_graph_params().attn_params[size]`` beside upstream's tuples, with
    its event and handle at the same positions of ``events[size]`` / ``handles[size]``. Upstream's own records of
    plain layers are tagged with their layer name (:class:`UpstreamAttnParams`, still upstream's tuple) by
    :func:`run_naming_upstream_records`, which the forward patch wraps around upstream's code. The capture is refused
    (:class:`AclGraphCaptureError`) for a non-DecodeOnly batch, a speculative-decoding draft model, or when the
    layout's update entry points are not all our wrapper (:func:`update_entry_points`).

    *Update* (:func:`_update_attn_params` wraps the layout's entry point, and is rebound wherever the release imported
    it by value - docs/upstream.md §7.5): without GPT-OSS
    records the call goes to upstream unchanged. Otherwise every record is paired with its layer's metadata **by
    layer name** - upstream zips ``forward_context.attn_metadata`` keys with ``attn_params`` by position, which with
    GPT-OSS's alternating layers and our records beside upstream's would pair layers and records wrongly. Upstream's
    records are handed to upstream's code with a view holding only them (``GraphParams`` swapped for the call) and a
    forward context whose ``attn_metadata`` lists exactly their layers in their order; ours are re-issued on the
    update stream between ``graph_task_update_begin/end`` with the step's lengths, then their event is recorded.
    An update that cannot be made raises :class:`AclGraphUpdateError` naming the layer and capture size and saying
    how to run PIECEWISE or eager; the event stays unrecorded, so the replay never runs stale lengths silently.
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.14.0rc1, one entry point per layout (docs/upstream.md §7.3), all wrapped by the same
    :func:`_update_attn_params`:

    * B (0.11.x): ``acl_graph.update_attn_params(update_stream, forward_context, runtime_shape[, kv_transfer_config])``
      (upstream records: ``_npu_paged_attention`` 9-tuples); rebound in ``model_runner_v1``;
    * C (0.12.0rc1): ``update_attn_params(update_stream, forward_context, runtime_shape)`` (upstream records: the
      13-tuples of ``full_graph_attention``, FIA ``.out``); rebound in ``model_runner_v1``;
    * E (0.13.0rc1 ``(..., vllm_config)``, 0.13.0rc2 - 0.13.0 ``(..., vllm_config, draft_attn_metadatas=None)``):
      dispatches to ``_update_attn_pa_params`` / ``_update_attn_fia_params`` (``full_graph_pa`` 9-tuples or
      ``full_graph_fia`` 13-tuples); rebound in ``model_runner_v1`` and ``spec_decode.eagle_proposer``;
    * F (0.14.0rc1): ``update_full_graph_params(attn_backend, ...)`` calls the staticmethod
      ``AscendAttentionBackendImpl.update_graph_params(update_stream, forward_context, num_tokens, vllm_config,
      speculative_config=None, num_dcp_pcp_tokens=None)``, which is wrapped (looked up on the class at every call,
      nothing to rebind). Upstream pairs ``attn_metadata`` keys and records by position; 0.14 also gives GPT-OSS's
      sliding layers their own KV-cache group (``SlidingWindowSpec``, docs/upstream.md §8.4), so per-layer metadata differ between
      groups - pairing by layer name is what keeps each record on its own layer's lengths.
    * H, G (0.15.0rc1 - 0.18.0): the same staticmethod (``draft_attn_metadatas=None`` added); the sink/window layers
      reach the capture through our ``forward_impl`` wrapper (:mod:`gptoss_patch.patches.attention`).
    * I (0.19.1rc1): the same staticmethod; upstream's own forward sends every captured layer to ``full_graph_fia``
      (FIA v1, ``sparse_mode 3``, no sinks), which ``attention_graph.capture_sinks`` (:func:`_full_graph_fia`) wraps so
      that a sink layer of a GPT-OSS process is captured by :func:`capture_decode` instead (docs/upstream.md §4.2).
    * 0.20.2rc1 and later capture sink layers themselves (``full_graph_fia_v2``, PR #9165): nothing registered.

    From 0.12.0rc1 on the forward patch sits on ``forward_impl``, which has no ``layer`` argument: the layer name is
    found in ``forward_context.no_compile_layers`` (:func:`layer_name_of`).
Remove when
    the oldest supported vllm-ascend captures sink/window attention itself (commit 8da8e0e6db, PR #9165, first in
    v0.20.2rc1), or gptoss-patch drops FULL_DECODE_ONLY support.
"""

from __future__ import annotations

import copy
import sys
import threading
from typing import Any, Callable

from gptoss_patch.fingerprint import split_target
from gptoss_patch.registry import PatchSpec
from gptoss_patch.patches.attention_graph.capture import (AclGraphCaptureError, AclGraphUpdateError, GptOssAttnParams,
                                                          _acl_graph, capture_decode, layer_name_of)

PATCH_NAME = "attention_graph.update_attn_params"

_swap_lock = threading.Lock()


_HEAD = (("update_stream",), ("forward_context",), ("runtime_shape", "num_tokens"))


def _split_update_args(args: tuple, kwargs: dict) -> tuple[list, tuple, dict]:
    """``([update_stream, forward_context, size], remaining positional, remaining keyword)``."""
    head = list(args[:3])
    rest = tuple(args[3:])
    kw = dict(kwargs)
    for aliases in _HEAD[len(head):]:
        name = next((a for a in aliases if a in kw), None)
        if name is None:
            raise TypeError(f"graph-parameter update called without {aliases[0]!r}")
        head.append(kw.pop(name))
    return head, rest, kw


def _launch_lengths(rec: GptOssAttnParams, metadata: Any, size: int, cache: dict) -> tuple[list[int], list[int]]:
    """The step's lengths for ``rec`` from its own layer's metadata (host lists only; raises the named error)."""
    from gptoss_patch.kernels import attention as kernels

    if not isinstance(metadata, dict):
        raise AclGraphUpdateError(rec.layer_name, size, f"forward_context.attn_metadata is "
                                                        f"{type(metadata).__name__}, not a per-layer dict")
    meta = metadata.get(rec.layer_name)
    if meta is None:
        raise AclGraphUpdateError(rec.layer_name, size, "forward_context.attn_metadata has no entry for this layer")
    hit = cache.get(id(meta))
    if hit is None:
        try:
            hit = kernels.decode_launch_lengths(meta.actual_seq_lengths_q, meta.seq_lens_list, meta.num_actual_tokens,
                                                size)
        except (ValueError, TypeError, AttributeError) as exc:
            raise AclGraphUpdateError(rec.layer_name, size, f"unusable metadata ({exc})") from exc
        cache[id(meta)] = hit
    q_cu, kv = hit
    if len(q_cu) != rec.capture_size:  # decode: one row per sequence, T rows = T block-table rows
        raise AclGraphUpdateError(rec.layer_name, size, f"{len(q_cu)} sequences for the {rec.capture_size} "
                                                        "block-table rows captured")
    if kv and max(kv) > rec.max_blocks * rec.block_size:
        raise AclGraphUpdateError(rec.layer_name, size, f"a sequence of {max(kv)} tokens exceeds the captured block "
                                                        f"table ({rec.max_blocks} blocks of {rec.block_size})")
    return hit


def _update_upstream(wrapped: Callable[..., Any], head: list, rest: tuple, kw: dict, theirs: list, ours_names: set,
                     gp: Any) -> None:
    """Let upstream's ``update_attn_params`` update its own records, each paired with its own layer's metadata."""
    update_stream, forward_context, size = head
    metadata = forward_context.attn_metadata
    names = [getattr(p, "layer_name", None) for p, _, _ in theirs]
    if any(n is None for n in names):
        # records captured without our naming (not through the patched forward): upstream's positional rule,
        # restricted to the layers that are not ours
        names = [k for k in metadata if k not in ours_names][:len(theirs)]
    if len(names) != len(theirs) or len(set(names)) != len(names) or any(n not in metadata for n in names):
        raise AclGraphUpdateError(None, size, f"cannot pair upstream's {len(theirs)} paged-attention records with "
                                              f"the step's layers (found {names})")
    view = _acl_graph().GraphParams(events={size: [e for _, _, e in theirs]}, workspaces=gp.workspaces,
                                    handles={size: [h for _, h, _ in theirs]},
                                    attn_params={size: [p for p, _, _ in theirs]})
    fc_view = copy.copy(forward_context)
    fc_view.attn_metadata = {n: metadata[n] for n in names}
    acl_graph = _acl_graph()
    with _swap_lock:
        saved = acl_graph._graph_params
        acl_graph._graph_params = view
        try:
            wrapped(update_stream, fc_view, size, *rest, **kw)
        finally:
            acl_graph._graph_params = saved


def _update_attn_params(wrapped, instance, args, kwargs):
    """wrapt wrapper for every graph-parameter update entry point: our records by layer name, upstream's by upstream
    (see the module docstring). The entry points (docs/upstream.md §7.3):

    * 0.11.x: ``acl_graph.update_attn_params(update_stream, forward_context, runtime_shape[, kv_transfer_config])``;
    * 0.12.0rc1: ``acl_graph.update_attn_params(update_stream, forward_context, runtime_shape)`` (FIA records);
    * 0.13.x: ``acl_graph.update_attn_params(update_stream, forward_context, runtime_shape, vllm_config[,
      draft_attn_metadatas])`` (PA or FIA records, chosen by ``using_paged_attention``);
    * 0.14.0rc1: the staticmethod ``AscendAttentionBackendImpl.update_graph_params(update_stream, forward_context,
      num_tokens, vllm_config, speculative_config=None, num_dcp_pcp_tokens=None)``, called by
      ``acl_graph.update_full_graph_params``.

    A draft model's update (``forward_context.is_draft_model``, 0.13+: its records live in the draft graph params,
    where GPT-OSS records are never captured) goes to upstream unchanged.

    Host work only for our records: a dictionary lookup, the lengths of each distinct metadata object, one
    re-issued launch and one event record per layer; no tensor is allocated or read.

    Raises:
        AclGraphUpdateError: a GPT-OSS record could not be updated (names layer and capture size).
    """
    head, rest, kw = _split_update_args(args, kwargs)
    update_stream, forward_context, size = head
    if getattr(forward_context, "is_draft_model", False):
        return wrapped(*args, **kwargs)
    gp = _acl_graph().get_graph_params()
    params = gp.attn_params.get(size) if gp is not None else None
    if not params or not any(type(p) is GptOssAttnParams for p in params):
        return wrapped(*args, **kwargs)
    import torch
    import torch_npu

    from gptoss_patch.kernels import attention as kernels

    handles, events = gp.handles[size], gp.events[size]
    if not len(params) == len(handles) == len(events):
        raise AclGraphUpdateError(None, size, f"graph parameters are inconsistent: {len(params)} records, "
                                              f"{len(handles)} handles, {len(events)} events")
    ours, theirs = [], []
    for entry in zip(params, handles, events):
        (ours if type(entry[0]) is GptOssAttnParams else theirs).append(entry)
    cache: dict = {}
    launches = [_launch_lengths(rec, forward_context.attn_metadata, size, cache) for rec, _, _ in ours]
    if theirs:
        _update_upstream(wrapped, head, rest, kw, theirs, {rec.layer_name for rec, _, _ in ours}, gp)
    with torch.npu.stream(update_stream):
        for (rec, handle, event), (q_cu, kv) in zip(ours, launches):
            try:
                torch.npu.graph_task_update_begin(update_stream, handle)
                kernels.relaunch_out(rec.path, rec.launch, rec.query, rec.key_cache, rec.value_cache,
                                     out=rec.output, softmax_lse=rec.softmax_lse, workspace=rec.workspace,
                                     query_cu_lens=q_cu, kv_lens=kv, torch_npu=torch_npu)
                torch.npu.graph_task_update_end(update_stream)
                event.record(update_stream)
            except AclGraphUpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure here leaves the replay stale: name it
                raise AclGraphUpdateError(rec.layer_name, size, f"{type(exc).__name__}: {exc}") from exc
            rec.query_cu_lens, rec.seq_lens = q_cu, kv
            rec.updates += 1
    return None


# ----------------------------------------------------------------------------------------------------------------
# which entry points must be our wrapper (asked by the capture: graph_capture.capture_decode's check_update)


def _active_layout() -> str | None:
    """The module-layout family (``gptoss_patch.matrix.LAYOUTS`` key) of the release gptoss-patch applied to."""
    from gptoss_patch._state import status

    return status(drift=False).layout  # None unless the decision is apply


def _live_attribute(target: str) -> tuple[Any, str, Any] | None:
    """``(parent, attribute, raw value)`` of an imported ``module:Qual.name`` (class attributes unbound), or None."""
    module, qualname = split_target(target)
    obj = sys.modules.get(module)
    if obj is None:
        return None
    parent, attribute = obj, qualname
    for part in qualname.split("."):
        parent, attribute = obj, part
        obj = parent.__dict__.get(part) if isinstance(parent, type) else getattr(parent, part, None)
        if obj is None:
            return None
    return parent, attribute, obj


def update_entry_points(layout: str) -> list[tuple[str, Any]]:
    """Where the graph-parameter update of ``layout`` is called from: ``(where, object)`` pairs, each of which must
    be our update wrapper for captured GPT-OSS records to be updated.

    Read from the matrix: the layout's ``attention_graph.*`` patches (:data:`PATCHES` named in
    :data:`gptoss_patch.matrix.LAYOUT_PATCHES`), their targets and ``rebind_keys`` (modules that imported the target's
    name by value, docs/upstream.md §7.5; only those already imported and holding the name).
    """
    from gptoss_patch import matrix

    places = []
    names = set(matrix.LAYOUT_PATCHES.get(layout, ()))
    for spec in PATCHES:
        target = matrix.LAYOUTS[layout].get(spec.target_key)
        if spec.name not in names or target is None or spec.wrapper is not _update_attn_params:  # not an update
            continue
        live = _live_attribute(target)
        places.append((target, live[2] if live else None))
        if live is None:
            continue
        for key in spec.rebind_keys:
            mod = sys.modules.get(matrix.LAYOUTS[layout].get(key, ""))
            if mod is not None and live[1] in mod.__dict__:
                places.append((f"{mod.__name__}.{live[1]}", mod.__dict__[live[1]]))
    return places


def check_update_patched(layer_name: str, size: int) -> None:
    """Refuse to capture a record nobody would update (the patch off, or a by-value name not rebound)."""
    layout = _active_layout()
    if layout is None:
        raise AclGraphCaptureError(layer_name, size, "gptoss-patch is not applied in this process, so the captured "
                                                     "lengths would never be updated")
    places = update_entry_points(layout)
    if not places:
        raise AclGraphCaptureError(layer_name, size, f"layout {layout} declares no ACL-graph update patch")
    for where, obj in places:
        if not is_patched(obj):
            raise AclGraphCaptureError(layer_name, size, f"{where} is not gptoss-patch's update wrapper (patch not "
                                                         "applied or rebinding failed), so the captured lengths "
                                                         "would never be updated")


def is_patched(fn: Any) -> bool:
    """True when ``fn`` is (or wraps, through wrapt proxies) our update wrapper.

    Checked by identity of the wrapper function along the ``__wrapped__`` chain, so another library's wrapper
    around ours still counts and a look-alike does not. Accepts a raw ``staticmethod`` too.
    """
    for _ in range(8):
        if fn is None:
            return False
        if getattr(fn, "_self_wrapper", None) is _update_attn_params:
            return True
        fn = fn.__func__ if isinstance(fn, staticmethod) else getattr(fn, "__wrapped__", None)
    return False


def _full_graph_fia(wrapped, instance, args, kwargs):
    """wrapt wrapper for vllm-ascend 0.19.1rc1's ``AscendAttentionBackendImpl.full_graph_fia(query, key, value,
    attn_metadata, output, layer=None) -> (output, num_tokens)`` (layout I, ``attention_graph.capture_sinks``).

    Upstream's FULL_DECODE_ONLY capture (``forward_fused_infer_attention`` sends every layer here while capturing)
    launches FIA v1 with ``sparse_mode 3`` and neither sinks nor a window, and its ``update_graph_params`` re-issues
    the same (docs/upstream.md §4.2). A layer with sinks is captured by :func:`capture_decode` instead - our call
    with ``learnable_sink`` and the 128-key band (the model's window, :func:`gptoss_patch.kernels.attention.
    model_window`) over the paged cache upstream's ``forward`` has just written (``self.key_cache``), into
    ``output`` - and ``attention_graph.update_graph_params`` re-issues it with each step's lengths. Layers without
    sinks, and every layer in a process that built no GPT-OSS model (:data:`gptoss_patch._state.gpt_oss_built`), run
    upstream's code. Shapes: ``query`` ``[T, N, D]`` (T = the capture size), ``output`` ``[T, N, D]``; returns
    ``(output, T)`` like upstream.
    """
    from gptoss_patch import _state

    if getattr(instance, "sinks", None) is None or not _state.gpt_oss_built:  # other models: upstream's capture
        return wrapped(*args, **kwargs)
    query, attn_metadata, output = _bind_full_graph_fia(*args, **kwargs)
    n, d = instance.num_heads, instance.head_size
    capture_decode(instance, layer_name_of(instance), query.view(-1, n, d), output.view(-1, n, d), attn_metadata,
                   check_update=check_update_patched)
    return output, int(query.shape[0])


def _bind_full_graph_fia(query, key, value, attn_metadata, output, layer=None):
    return query, attn_metadata, output


_SUMMARY = ("FULL_DECODE_ONLY graphs re-issue GPT-OSS sink/window attention with each step's lengths, records "
            "paired with layers by name")

PATCHES = [
    PatchSpec(  # 0.11.x (B) and 0.12.0rc1 (C)
        name=PATCH_NAME,
        target_key="aclgraph_update_attn_params",
        wrapper=_update_attn_params,
        params=("update_stream", "forward_context", "runtime_shape"),
        rebind_keys=("model_runner_module",),
        summary=_SUMMARY,
    ),
    PatchSpec(  # 0.13.0rc1 (vllm_config) ... 0.13.0 (vllm_config, draft_attn_metadatas=None): E
        name="attention_graph.update_attn_params_013",
        target_key="aclgraph_update_attn_params_013",
        wrapper=_update_attn_params,
        params=("update_stream", "forward_context", "runtime_shape", "vllm_config"),
        rebind_keys=("model_runner_module", "aclgraph_eagle_proposer_module"),
        summary=_SUMMARY,
    ),
    PatchSpec(  # 0.14.0rc1 (F), 0.15.0rc1 - 0.19.1rc1 (H, G, I): the staticmethod update_full_graph_params calls
        name="attention_graph.update_graph_params",
        target_key="aclgraph_update_graph_params",
        wrapper=_update_attn_params,
        params=("update_stream", "forward_context", "num_tokens", "vllm_config"),
        summary=_SUMMARY,
    ),
    PatchSpec(  # 0.19.1rc1 (I): upstream's own forward sends every captured layer to full_graph_fia (FIA v1, no sinks)
        name="attention_graph.capture_sinks",
        target_key="attention_impl_full_graph_fia",
        wrapper=_full_graph_fia,
        params=("query", "key", "value", "attn_metadata", "output"),
        defect_absent=("learnable_sink",),
        summary="FULL_DECODE_ONLY captures GPT-OSS's sink layers with our updatable call instead of FIA v1 without "
                "sinks",
    ),
]
