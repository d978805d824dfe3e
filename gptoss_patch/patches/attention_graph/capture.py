"""ACL graph, capture side: GPT-OSS decode attention captured as one updatable task, and the records it leaves.

The records (:class:`GptOssAttnParams` for our launches, :class:`UpstreamAttnParams` for upstream's, named by layer)
are what the update patch (:mod:`gptoss_patch.patches.attention_graph.update`, its module docstring says why and how) re-issues
with each step's lengths. This module is called by the attention patch (:mod:`gptoss_patch.patches.attention`)
during a FULL_DECODE_ONLY capture, and refuses a capture that no update would ever touch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: How to get out of full-graph mode (in every capture / update error).
HOW_TO_AVOID = ("run PIECEWISE (--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}') or eager "
                "(--enforce-eager) instead of FULL_DECODE_ONLY")

class AclGraphUpdateError(RuntimeError):
    """The captured attention of one layer could not be updated for this step (its replay would be stale).

    Attributes:
        layer_name: the attention layer (``model.layers.N.self_attn.attn``).
        capture_size: the graph's capture size (``runtime_shape``).
    """

    def __init__(self, layer_name: str | None, capture_size: int, what: str):
        self.layer_name, self.capture_size = layer_name, capture_size
        super().__init__(
            f"gptoss-patch: ACL graph update failed for attention layer {layer_name!r} at capture size "
            f"{capture_size}: {what}. The captured attention would replay with stale sequence lengths, so the step "
            f"stops here; {HOW_TO_AVOID}.")


class AclGraphCaptureError(RuntimeError):
    """A GPT-OSS attention layer cannot be captured as an updatable task (FULL_DECODE_ONLY)."""

    def __init__(self, layer_name: str | None, capture_size: int, what: str):
        self.layer_name, self.capture_size = layer_name, capture_size
        super().__init__(
            f"gptoss-patch: cannot capture GPT-OSS attention layer {layer_name!r} in a full ACL graph at capture "
            f"size {capture_size}: {what}; {HOW_TO_AVOID}.")


@dataclass(eq=False)
class GptOssAttnParams:
    """What one captured GPT-OSS attention launch needs to be re-issued (one per layer and capture size).

    Tensors are those of the capture (the graph reads them at fixed addresses); the update passes the same ones.

    Attributes:
        layer_name: vLLM attention layer name (key of ``forward_context.attn_metadata``).
        capture_size: T, rows of the launch (``runtime_shape``).
        path: ``"v2"`` (``npu_fused_infer_attention_score_v2.out`` with ``learnable_sink``) or ``"lse"``
            (``npu_fused_infer_attention_score.out``; with sinks, ``softmax_lse`` + ``sink_rescale_`` after the group).
        query: ``(T, N, D)`` captured query.
        key_cache / value_cache: ``(num_blocks, block_size, KV_N*D)`` views of the layer's paged caches.
        block_table: ``(T, max_blocks)`` int32 - the capture's tensor, a view of the model runner's persistent block
            table (``input_batch.block_table``), updated in place every step (as upstream's paged records).
        query_cu_lens / seq_lens: host lists the graph currently holds (capture, then each update).
        sinks: ``(N,)`` sink logits (the model's parameter) or None; sliding_window: 128 or None.
        scale: softmax scale; num_heads / num_kv_heads: N, KV_N on this rank.
        output: ``(T, N, D)`` captured output buffer (what vLLM reads after the layer).
        softmax_lse: float32 ``(T, N, 1)`` on the ``lse`` path with sinks, else a ``(1,)`` placeholder.
        workspace: from ``_npu_fused_infer_attention_score(_v2)_get_max_workspace`` (shared per size/geometry).
        launch: the launch's keyword arguments (``kernels.attention.fia_kwargs``: mask, band, heads, scale, sinks,
            block table, block size; capture-time lengths), reused by every update with new lengths only.
        block_size / max_blocks: of the caches and the captured block table (host ints, for the update's checks).
        updates: updates applied so far.
    """

    layer_name: str
    capture_size: int
    path: str
    query: Any
    key_cache: Any
    value_cache: Any
    block_table: Any
    query_cu_lens: list[int]
    seq_lens: list[int]
    sinks: Any
    sliding_window: int | None
    scale: float
    num_heads: int
    num_kv_heads: int
    output: Any
    softmax_lse: Any
    workspace: Any
    launch: dict = field(default_factory=dict)
    block_size: int = 0
    max_blocks: int = 0
    updates: int = 0


class UpstreamAttnParams(tuple):
    """Upstream's paged-attention record ``(query, key_cache, value_cache, num_kv_heads, num_heads, scale,
    block_table, seq_lens, output)`` with the ``layer_name`` that produced it. Unpacks exactly like the tuple."""

    layer_name: str

    def __new__(cls, items: tuple, layer_name: str) -> "UpstreamAttnParams":
        self = super().__new__(cls, items)
        self.layer_name = layer_name
        return self


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _forward_context() -> Any:
    """vLLM's current forward context, or None outside one (vLLM 0.11 has no ``is_forward_context_available``)."""
    from vllm import forward_context

    return forward_context._forward_context


def _acl_graph() -> Any:
    from vllm_ascend.compilation import acl_graph

    return acl_graph


def capturing() -> bool:
    """True when the current attention call is being captured into a full graph.

    ``forward_context.capturing`` (set by ``ACLGraphWrapper`` before a capture) *and* the current stream capturing:
    in PIECEWISE mode the wrapper leaves the flag set while attention runs eagerly between captured pieces.
    """
    fc = _forward_context()
    if fc is None or not getattr(fc, "capturing", False):
        return False
    import torch

    return bool(torch.npu.is_current_stream_capturing())


def _weak(t: Any) -> Any:
    """``vllm_ascend.utils.weak_ref_tensor`` as upstream stores its records, when the compiled op exists."""
    import torch

    try:
        op = torch.ops._C_ascend.weak_ref_tensor
    except (AttributeError, RuntimeError):
        return t  # e.g. the CPU simulator: a strong reference (more memory held, same addresses)
    return op(t)


def layer_name_of(impl: Any) -> str | None:
    """vLLM layer name of an ``AscendAttentionBackendImpl`` (vllm-ascend >= 0.12 does not pass the layer to
    ``forward_impl``): the key of ``forward_context.no_compile_layers`` whose ``Attention`` holds ``impl``
    (vLLM's static forward context, the table ``unified_attention_with_output`` looks layers up in). Cached on the
    impl. None when not found."""
    name = impl.__dict__.get("_gptoss_layer_name")
    if name:
        return name
    fc = _forward_context()
    layers = getattr(fc, "no_compile_layers", None) or {}
    for key, layer in layers.items():
        if getattr(layer, "impl", None) is impl:
            impl._gptoss_layer_name = key
            return key
    return None


def _workspace(gp: Any, key: tuple, make: Callable[[], Any]) -> Any:
    """Workspace cache on the GraphParams object, per capture size and launch geometry.

    Not ``gp.workspaces``: upstream's paged-attention capture reuses ``workspaces[num_tokens]`` for its own
    ``_npu_paged_attention`` (sized by ``_npu_paged_attention_get_workspace``), a different operator.
    """
    cache = gp.__dict__.setdefault("_gptoss_workspaces", {})
    ws = cache.get(key)
    if ws is None:
        ws = cache[key] = make()
    return ws


# ----------------------------------------------------------------------------------------------------------------
# capture


def _capture_lengths(attn_metadata: Any, size: int) -> tuple[list[int], list[int]]:
    """Query (cumulative) and KV lengths for the captured launch of a DecodeOnly batch of ``size`` rows.

    The real step's lengths when the metadata has them (:func:`gptoss_patch.kernels.attention.decode_launch_lengths`).
    vLLM-ascend 0.11's capture dummy run does not: ``NPUModelRunner._build_attention_metadata`` (``aclgraph_runtime_mode
    == FULL``) hands the builder the runner's ``query_start_loc_cpu`` buffer as it stands before any request - all
    zeros - so ``actual_seq_lengths_q`` is ``[0, ..., 0]`` while ``num_actual_tokens`` is ``size`` (found by running
    vLLM's real engine on the simulator). The lengths captured then are placeholders the per-step update replaces
    before every replay (:func:`gptoss_patch.patches.attention_graph.update.update_attn_params`), as upstream's own paged-attention capture does: one query token
    per row, and the metadata's KV lengths (at least 1) for the rows.

    Raises:
        ValueError: lengths that are neither a real step's nor the all-zero capture buffer.
    """
    from gptoss_patch.kernels import attention as kernels

    q = list(attn_metadata.actual_seq_lengths_q)
    try:
        return kernels.decode_launch_lengths(q, attn_metadata.seq_lens_list, attn_metadata.num_actual_tokens, size)
    except ValueError:
        if not q or any(q) or attn_metadata.num_actual_tokens != size:
            raise
    kv = [max(int(x), 1) for x in list(attn_metadata.seq_lens_list)[:size]]
    kv += [1] * (size - len(kv))
    return list(range(1, size + 1)), kv



def capture_decode(impl: Any, layer_name: str | None, query: Any, output: Any, attn_metadata: Any,
                   check_update: Callable[[str, int], None] | None = None) -> Any:
    """Capture one GPT-OSS decode attention as an updatable task; record it in ``get_graph_params()``.

    Called by :func:`gptoss_patch.patches.attention.sink_window_attend` (after the KV-cache write) when
    :func:`capturing`. Writes into ``output``.

    Args:
        impl: the ``AscendAttentionBackendImpl`` (``sinks``, ``sliding_window``, ``key_cache`` ..., set).
        layer_name: the vLLM attention layer's name (keys the record; ``forward_context.attn_metadata`` key).
        query: ``(T, N, D)``, T = the capture size; output: ``(T, N, D)`` buffer.
        attn_metadata: the layer's ``AscendMetadata`` (DecodeOnly, built by ``build_for_graph_capture``).
        check_update: ``check_update(layer_name, size)`` raises :class:`AclGraphCaptureError` when no update would
            re-issue the record (the attention patch passes
            :func:`gptoss_patch.patches.attention_graph.update.check_update_patched`).

    Returns:
        ``output``.

    Raises:
        AclGraphCaptureError: not a DecodeOnly batch, no graph params for size T (``set_graph_params`` not called),
            a block table whose rows do not match the launch, or the update patch not active.
        SinkAttentionUnavailable: no updatable operator path (see ``kernels.attention.graph_path``).
    """
    import torch
    import torch_npu
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    from gptoss_patch.kernels import attention as kernels

    name = layer_name
    size = int(query.shape[0])
    if attn_metadata.attn_state != AscendAttentionState.DecodeOnly:
        raise AclGraphCaptureError(name, size, f"attention state {attn_metadata.attn_state.name}: only DecodeOnly "
                                               "batches are captured with updatable lengths")
    if getattr(_forward_context(), "is_draft_model", False):
        raise AclGraphCaptureError(name, size, "a speculative-decoding draft model's layer with sinks or a sliding "
                                               "window (its records would go to the draft graph parameters, which "
                                               "gptoss-patch does not update)")
    gp = _acl_graph().get_graph_params()
    if gp is None or size not in gp.attn_params:
        raise AclGraphCaptureError(name, size, "no graph parameters for this size (set_graph_params was not called "
                                               "with it)")
    if not name:
        raise AclGraphCaptureError(name, size, "the attention layer has no layer_name to pair its record with")
    if check_update is not None:
        check_update(name, size)
    sinks = impl.sinks
    window = kernels.model_window(impl)
    path = kernels.graph_path(sinks is not None)
    q_cu, kv = _capture_lengths(attn_metadata, size)
    block_table = attn_metadata.block_tables
    if block_table.shape[0] != len(q_cu):
        raise AclGraphCaptureError(name, size, f"block table has {block_table.shape[0]} rows for {len(q_cu)} "
                                               "sequences")
    key, value, block_size = kernels.paged_views(impl.key_cache, impl.value_cache)
    n, kvn, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    if path == kernels.LSE and sinks is not None:
        lse = torch.empty(size, n, 1, dtype=torch.float32, device=query.device)
    else:
        lse = torch.empty(1, dtype=torch.float32, device=query.device)
    geometry = dict(block_table=block_table, query_cu_lens=q_cu, kv_lens=kv, num_heads=n, num_kv_heads=kvn,
                    scale=impl.scale, sinks=sinks, sliding_window=window)
    ws_key = (size, path, n, kvn, d, query.dtype, block_size, window is not None, sinks is not None)
    workspace = _workspace(gp, ws_key, lambda: kernels.max_workspace(path, query, key, value, **geometry))

    launch = kernels.fia_kwargs(path, block_table=block_table, block_size=block_size, query_cu_lens=q_cu, kv_lens=kv,
                                num_heads=n, num_kv_heads=kvn, scale=impl.scale, sinks=sinks,
                                sliding_window=window, mask=kernels.causal_template(torch.int8, query.device))
    stream = torch_npu.npu.current_stream()
    event = torch.npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    kernels.relaunch_out(path, launch, query, key, value, out=output, softmax_lse=lse, workspace=workspace)
    handle = torch.npu.graph_task_group_end(stream)
    if path == kernels.LSE and sinks is not None:
        kernels.sink_rescale_(output, lse, sinks)
    record = GptOssAttnParams(
        layer_name=name, capture_size=size, path=path, query=_weak(query), key_cache=_weak(key),
        value_cache=_weak(value), block_table=block_table, query_cu_lens=q_cu, seq_lens=kv, sinks=sinks,
        sliding_window=window, scale=impl.scale, num_heads=n, num_kv_heads=kvn, output=_weak(output),
        softmax_lse=lse, workspace=workspace, launch=launch, block_size=block_size,
        max_blocks=int(block_table.shape[1]))
    gp.events[size].append(event)
    gp.attn_params[size].append(record)
    gp.handles[size].append(handle)
    return output


def run_naming_upstream_records(layer_name: Callable[[], str | None], call: Callable[[], Any]) -> Any:
    """Run upstream's attention (``call``) for a plain layer; name any graph record it captured.

    Outside a full-graph capture this is just ``call()``. During one, a tuple upstream appended to
    ``get_graph_params().attn_params[size]`` (0.11 paged attention 9-tuple; 0.12 ``full_graph_attention`` and 0.13+
    ``full_graph_fia`` 13-tuples, ``full_graph_pa`` 9-tuples) becomes an :class:`UpstreamAttnParams` carrying the
    layer's name (``layer_name()``), so the update can pair it with its own layer's metadata.
    """
    fc = _forward_context()
    if fc is None or not getattr(fc, "capturing", False):
        return call()
    gp = _acl_graph().get_graph_params()
    if gp is None:
        return call()
    before = {size: len(lst) for size, lst in gp.attn_params.items()}
    result = call()
    name = layer_name()
    if name:
        for size, lst in gp.attn_params.items():
            for i in range(before.get(size, 0), len(lst)):
                if type(lst[i]) is tuple:
                    lst[i] = UpstreamAttnParams(lst[i], name)
    return result


# ----------------------------------------------------------------------------------------------------------------
# update


#: The first three parameters of every update entry point (the third is ``num_tokens`` in 0.14's staticmethod).
