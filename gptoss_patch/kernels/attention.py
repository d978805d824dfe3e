"""GPT-OSS attention (learned sinks, sliding window) on the fused NPU operators, and its plain-torch math.

Two operator paths compute the same thing (``docs/operators.md`` §3):

* ``v2``: ``torch_npu.npu_fused_infer_attention_score_v2(..., learnable_sink=sinks)`` - the sink is
  an extra, unscaled logit in every softmax row (OPD-fia2 ``learnable_sink``; OTX-pfa ``Bmm2ResultDiv``),
  as in the reference model (transformers ``GptOssAttention``: ``cat([scores, sinks]).softmax()[..., :-1]``).
* ``lse``: ``torch_npu.npu_fused_infer_attention_score(..., softmax_lse_flag=True)`` and the exact
  identity ``out_sink = out · sigmoid(lse − sink)`` (:func:`sink_rescale`), for a torch_npu whose v2
  lacks ``learnable_sink``.

Both use the TND layout over the paged KV cache (``block_table``; per-sequence KV lengths; cumulative
query lengths). Full-attention layers use ``sparse_mode=3`` (right-down causal). Sliding-window
layers use the band ``sparse_mode=4`` with ``pre_tokens = sliding_window − 1``, ``next_tokens = 0``:
the band admits ``pre_tokens + 1`` keys ending at the query's own position (OPD-fia ``sparse_mode``
table; OTX-pfa band offsets), so ``window − 1`` gives exactly the reference model's 128 keys including the
current one (transformers ``sliding_window_overlay``: ``kv_idx > q_idx − sliding_window``).
vllm-ascend ≥ 0.15 passes ``pre_tokens = sliding_window`` and admits 129 (docs/operators.md §3.4).

Modes 3 and 4 take the same compressed 2048×2048 causal template as ``atten_mask`` (the band's
geometry comes from the mode and pre/next; OPD-fia "Q_S>1" mask constraints, vllm-ascend PR #8387),
so one mask per (dtype, device) serves every layer and window; it is built once and cached.

ACL graphs (FULL_DECODE_ONLY): :func:`fia_kwargs` + :func:`relaunch_out` are the ``.out`` launch a captured graph
holds - it writes into the caller's output, LSE and workspace buffers, one operator launch per layer, so
:mod:`gptoss_patch.patches.attention_graph.update` can re-issue it with new lengths in a task-group update (the capture:
:func:`gptoss_patch.patches.attention_graph.capture.capture_decode`; on the ``lse`` path :func:`sink_rescale_` follows).
:func:`graph_path` picks the operator that can be updated on this torch_npu (v2 needs op-plugin 7.3.0);
:func:`decode_launch_lengths` turns vllm-ascend's padded decode metadata into lengths that cover every row.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Sequence

import torch

from gptoss_patch import config

#: ``pre_tokens`` / ``next_tokens`` default of the operators ("no limit").
INT_MAX = 2147483647
#: Side of the compressed mask template the fused operator expects for sparse modes 2-4.
MASK_TEMPLATE_SIZE = 2048

V2 = "v2"
LSE = "lse"
_PATH_TEXT = {
    V2: "npu_fused_infer_attention_score_v2 with learnable_sink (TND, paged KV)",
    LSE: "npu_fused_infer_attention_score + softmax_lse, out * sigmoid(lse - sink) (TND, paged KV)",
}

_lock = threading.Lock()
_path: str | None = None
_masks: dict[tuple[torch.dtype, Any], torch.Tensor] = {}


class SinkAttentionUnavailable(RuntimeError):
    """Neither operator path can honour attention sinks on this torch_npu: GPT-OSS cannot run correctly."""


def _accepts(fn: Any, name: str) -> bool:
    """True when operator ``fn`` (a torch_npu op or a Python function) has an argument called ``name``."""
    if fn is None or not callable(fn) or not bool(fn):
        return False
    default = getattr(fn, "default", None)  # torch.ops OpOverloadPacket -> schema
    schema = getattr(default, "_schema", None)
    if schema is not None:
        return any(a.name == name for a in schema.arguments)
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def detect_path(torch_npu: Any) -> str:
    """Pick the operator path for this process from what the installed ``torch_npu`` offers.

    ``GPTOSS_PATCH_ATTENTION_PATH`` = ``v2`` or ``lse`` forces one (an unavailable choice is an
    error, never silently replaced).

    Raises:
        SinkAttentionUnavailable: neither v2 with ``learnable_sink`` nor v1 with ``softmax_lse_flag``.
        ValueError: the environment variable holds another value.
    """
    v2 = _accepts(getattr(torch_npu, "npu_fused_infer_attention_score_v2", None), "learnable_sink")
    v1 = _accepts(getattr(torch_npu, "npu_fused_infer_attention_score", None), "softmax_lse_flag")
    forced = config.choice(config.ATTENTION_PATH) or ""
    if forced == V2 and not v2:
        raise SinkAttentionUnavailable("GPTOSS_PATCH_ATTENTION_PATH=v2 but torch_npu.npu_fused_infer_attention_score_v2 "
                                       "has no learnable_sink argument (needs torch_npu >= 2.7.1, op-plugin 7.2.0)")
    if forced == LSE and not v1:
        raise SinkAttentionUnavailable("GPTOSS_PATCH_ATTENTION_PATH=lse but torch_npu.npu_fused_infer_attention_score "
                                       "has no softmax_lse_flag argument")
    if forced:
        return forced
    if v2:
        return V2
    if v1:
        return LSE
    raise SinkAttentionUnavailable(
        "this torch_npu offers neither npu_fused_infer_attention_score_v2(learnable_sink=...) nor "
        "npu_fused_infer_attention_score(softmax_lse_flag=True); GPT-OSS attention sinks cannot be computed "
        "(install the torch-npu pinned by your vllm-ascend release)")


def chosen_path(torch_npu: Any | None = None) -> str:
    """The process-wide operator path (detected once, on first use); see :func:`detect_path`."""
    global _path
    if _path is None:
        with _lock:
            if _path is None:
                if torch_npu is None:
                    import torch_npu as _tn

                    torch_npu = _tn
                _path = detect_path(torch_npu)
    return _path


def path_description() -> str | None:
    """Human text of the chosen path, or None before any GPT-OSS layer needed it."""
    return _PATH_TEXT[_path] if _path else None


def causal_template(dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The cached ``(2048, 2048)`` causal template (1 above the diagonal = masked) for modes 3 and 4.

    Args:
        dtype: mask dtype (``torch.int8`` as vllm-ascend's ``get_splitfuse_attn_mask``, or ``torch.bool``).
        device: where the operator runs.
    """
    key = (dtype, str(device))
    mask = _masks.get(key)
    if mask is None:
        with _lock:
            mask = _masks.get(key)
            if mask is None:
                mask = torch.triu(torch.ones(MASK_TEMPLATE_SIZE, MASK_TEMPLATE_SIZE, dtype=dtype, device=device),
                                  diagonal=1)
                _masks[key] = mask
    return mask


def model_window(impl: Any) -> int | None:
    """The model's sliding window (keys, the current one included) of an attention impl: ``gptoss_window`` where
    ``attention.band_128_keys`` (layouts I, J) stored the operator's ``pre_tokens`` in ``sliding_window``, else
    ``sliding_window`` (128 or None). What :func:`band` takes."""
    return getattr(impl, "gptoss_window", getattr(impl, "sliding_window", None))


def band(sliding_window: int | None) -> tuple[int, int, int]:
    """``(sparse_mode, pre_tokens, next_tokens)`` for a layer: 3 (causal) or 4 with ``window − 1`` keys back.

    Raises:
        ValueError: a window < 1.
    """
    if sliding_window is None:
        return 3, INT_MAX, 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return 4, sliding_window - 1, 0


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Turn sink-free attention into attention with sinks: ``out · sigmoid(lse − sink)``.

    With ``Z = Σ_j exp(s_j − m)``, ``lse = m + ln Z``: ``Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink})
    = out · Z e^m / (Z e^m + e^{sink}) = out · sigmoid(lse − sink)`` - exact, no approximation.

    Args:
        out: ``(T, N, D)`` attention output without sinks.
        lse: ``(T, N, 1)`` float32 log-sum-exp of the attended scaled scores.
        sinks: ``(N,)`` sink logits (any float dtype).

    Returns:
        ``(T, N, D)`` in ``out``'s dtype (computed in float32).
    """
    scale = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * scale).to(out.dtype)


def sink_window_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    query_cu_lens: Sequence[int],
    kv_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    out: torch.Tensor,
    torch_npu: Any = None,
) -> torch.Tensor:
    """Attention with optional sinks and sliding window over the paged KV cache, written into ``out``.

    Args:
        query: ``(T, N, D)`` TND query, T = ``query_cu_lens[-1]``.
        key_cache / value_cache: ``(num_blocks, block_size, KV_N, D)`` paged caches (vllm-ascend layout).
        block_table: ``(B, max_blocks)`` int32.
        query_cu_lens: B cumulative query end offsets (host list).
        kv_lens: B per-sequence KV lengths including the new tokens (host list).
        num_heads / num_kv_heads: N and KV_N on this rank.
        scale: softmax scale (``head_dim ** -0.5``).
        sinks: ``(N,)`` sink logits, or None.
        sliding_window: window in tokens (128 for GPT-OSS even layers), or None.
        out: ``(T, N, D)`` buffer the result is written into.
        torch_npu: the operator module (default: ``import torch_npu``).

    Returns:
        ``out``. Makes no device-to-host synchronisation (all lengths are host lists).
    """
    if torch_npu is None:
        import torch_npu as _tn

        torch_npu = _tn
    path = chosen_path(torch_npu)
    key, value, block_size = paged_views(key_cache, value_cache)
    kwargs = fia_kwargs(path, block_table=block_table, block_size=block_size, query_cu_lens=query_cu_lens,
                        kv_lens=kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
                        sinks=sinks, sliding_window=sliding_window, mask=causal_template(torch.int8, query.device))
    if path == V2:
        res, _ = torch_npu.npu_fused_infer_attention_score_v2(query, key, value, **kwargs)
    else:
        res, lse = torch_npu.npu_fused_infer_attention_score(query, key, value, **kwargs)
        if sinks is not None:
            res = sink_rescale(res, lse, sinks)
    out.copy_(res)
    return out


def paged_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(key, value, block_size)``: the caches as the fused operator reads them, ``(num_blocks, block_size, KV_N*D)``.

    Accepts vllm-ascend's 4-D caches ``(num_blocks, block_size, KV_N, D)`` (viewed, no copy) or the 3-D views.
    """
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if key_cache.dim() == 3:
        return key_cache, value_cache, block_size
    return key_cache.view(num_blocks, block_size, -1), value_cache.view(num_blocks, block_size, -1), block_size


def fia_kwargs(path: str, *, block_table: torch.Tensor, block_size: int, query_cu_lens: Sequence[int],
               kv_lens: Sequence[int], num_heads: int, num_kv_heads: int, scale: float, sinks: torch.Tensor | None,
               sliding_window: int | None, mask: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments of one TND paged call of the fused operator of ``path`` (everything after query/key/value).

    ``v2``: ``npu_fused_infer_attention_score_v2`` names, ``learnable_sink=sinks``. ``lse``: the v1 names,
    ``softmax_lse_flag=True`` when there are sinks (the LSE feeds :func:`sink_rescale`). Both: ``input_layout="TND"``,
    :func:`band` for ``sparse_mode``/``pre_tokens``/``next_tokens``, the causal template ``mask``, host-list lengths
    (copied, so a caller's later edits do not reach a queued launch). Sources: docs/operators.md §3.7.
    """
    mode, pre, nxt = band(sliding_window)
    if path == V2:
        return dict(num_query_heads=num_heads, num_key_value_heads=num_kv_heads, input_layout="TND",
                    pre_tokens=pre, next_tokens=nxt, atten_mask=mask, sparse_mode=mode, softmax_scale=scale,
                    block_table=block_table, block_size=block_size, actual_seq_qlen=list(query_cu_lens),
                    actual_seq_kvlen=list(kv_lens), learnable_sink=sinks)
    return dict(atten_mask=mask, block_table=block_table, input_layout="TND", block_size=block_size,
                actual_seq_lengths=list(query_cu_lens), actual_seq_lengths_kv=list(kv_lens),
                num_key_value_heads=num_kv_heads, num_heads=num_heads, scale=scale, sparse_mode=mode,
                pre_tokens=pre, next_tokens=nxt, softmax_lse_flag=sinks is not None)


# ----------------------------------------------------------------------------------------------------------------
# ACL graph (FULL_DECODE_ONLY) form: the `.out` overloads, a preallocated LSE and workspace, updatable lengths.
# The capture / update protocol itself lives in gptoss_patch.patches.attention_graph.update.

#: First torch_npu release whose op-plugin line (7.3.0) can update a captured ``npu_fused_infer_attention_score_v2``
#: inside an NPU graph task group (op-plugin commit c2bbff98, PR !3925, 2025-12-30; docs/operators.md §3.8).
#: torch_npu 2.7.1 / 2.8.0 (vllm-ascend 0.11 - 0.13) are on 7.2.0: their v2 can run, but not be re-issued in a
#: captured task group, so captured sink layers use the v1 ``.out`` + LSE path there.
V2_GRAPH_UPDATE_MIN_TORCH_NPU = (2, 9, 0)


def v2_graph_update_supported(torch_npu: Any) -> bool:
    """True when ``torch_npu.__version__`` is at least :data:`V2_GRAPH_UPDATE_MIN_TORCH_NPU` (unparsable: False)."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(str(getattr(torch_npu, "__version__", ""))).release
    except InvalidVersion:
        return False
    return tuple(release[:3]) >= V2_GRAPH_UPDATE_MIN_TORCH_NPU


def graph_path(has_sinks: bool = True, torch_npu: Any | None = None) -> str:
    """The operator path for an attention launch captured in an ACL graph and re-issued by the update.

    * a layer without sinks (sliding window only): ``lse`` - the v1 ``.out``, no LSE, nothing to rescale;
    * process path ``lse`` (:func:`chosen_path`): ``lse``;
    * process path ``v2``: ``v2`` when ``GPTOSS_PATCH_ATTENTION_PATH=v2`` forces it (the user vouches that this
      torch_npu updates a captured v2) or :func:`v2_graph_update_supported`; otherwise ``lse`` (v1 ``.out`` with
      ``softmax_lse_flag`` and :func:`sink_rescale` - the same attention, rounding aside).

    Raises:
        SinkAttentionUnavailable: a sink layer whose v2 cannot be updated in a graph on this torch_npu and whose v1
            has no ``softmax_lse_flag`` (the message says to run PIECEWISE or eager).
    """
    if torch_npu is None:
        import torch_npu as _tn

        torch_npu = _tn
    path = chosen_path(torch_npu)
    if path == LSE or not has_sinks:
        return LSE
    forced = config.choice(config.ATTENTION_PATH) == V2
    if forced or v2_graph_update_supported(torch_npu):
        return V2
    if _accepts(getattr(torch_npu, "npu_fused_infer_attention_score", None), "softmax_lse_flag"):
        return LSE
    raise SinkAttentionUnavailable(
        f"torch_npu {getattr(torch_npu, '__version__', '?')} cannot update a captured "
        "npu_fused_infer_attention_score_v2 (needs torch_npu >= 2.9.0) and its npu_fused_infer_attention_score has no "
        "softmax_lse_flag: GPT-OSS attention cannot be captured in a full ACL graph. Run PIECEWISE "
        "(--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}') or eager (--enforce-eager)")


def decode_launch_lengths(query_cu_lens: Sequence[int], kv_lens: Sequence[int], num_actual_tokens: int,
                          num_tokens: int) -> tuple[list[int], list[int]]:
    """Lengths of one TND launch covering all ``num_tokens`` rows of a graph-padded decode batch.

    How the releases pad a DecodeOnly batch of ``num_actual_tokens`` up to ``num_input_tokens`` (the capture size):

    * vllm-ascend 0.11 (``AscendAttentionMetadataBuilder.build``): ``seq_lens`` padded with ones, zero block-table
      rows, ``query_start_loc`` extended by ``arange(last + 1, last + pad)`` - one entry fewer than the padding, so
      its last cumulative length is ``num_tokens - 1``;
    * 0.12.0rc1 (``NPUModelRunner._prepare_inputs``, FULL decode mode): the request count is padded, but only the
      device copy of ``query_start_loc`` gets the padding values - the host entries (``actual_seq_lengths_q``) and
      ``seq_lens`` beyond the real requests hold whatever an earlier step left there;
    * 0.13.x / 0.14.0rc1: host ``query_start_loc`` padded with ``arange``, ``seq_lens`` padded with zeros.

    The TND operator requires ``T`` == the last cumulative length (docs/operators.md §3.7). Here: the real sequences
    (up to the cumulative length equal to ``num_actual_tokens``; every entry after it is padding, whatever its value)
    keep their query/KV lengths; each padding row becomes its own one-token sequence with KV length 0, which the
    operator answers with a zero row (as vllm-ascend 0.13's ``_pad_attention_seq_params`` pads).

    Args:
        query_cu_lens: the metadata's ``actual_seq_lengths_q`` (host list, cumulative).
        kv_lens: the metadata's ``seq_lens_list`` (host list, per sequence, >= the real sequences).
        num_actual_tokens: real tokens of the step (``AscendMetadata.num_actual_tokens``).
        num_tokens: rows of the launch (the capture size).

    Returns:
        ``(query_cu_lens, kv_lens)`` host lists; the last query length is ``num_tokens``.

    Raises:
        ValueError: no cumulative length equals ``num_actual_tokens`` (or the real ones are not increasing), too
            few KV lengths, or ``num_tokens < num_actual_tokens``.
    """
    q = list(query_cu_lens)
    if num_actual_tokens == 0:
        real = 0
    else:
        try:
            real = q.index(num_actual_tokens) + 1
        except ValueError:
            raise ValueError(f"query lengths {q} do not reach the {num_actual_tokens} real tokens of the "
                             "step") from None
        if any(b <= a for a, b in zip([0, *q[:real - 1]], q[:real])):
            raise ValueError(f"query lengths {q[:real]} of the real sequences are not increasing")
    kv = list(kv_lens)
    if len(kv) < real:
        raise ValueError(f"{len(kv)} KV lengths for {real} sequences")
    pad = num_tokens - num_actual_tokens
    if pad < 0:
        raise ValueError(f"{num_actual_tokens} real tokens exceed the {num_tokens} rows of the launch")
    return q[:real] + list(range(num_actual_tokens + 1, num_tokens + 1)), kv[:real] + [0] * pad


def _op(torch_npu: Any, path: str) -> Any:
    return torch_npu.npu_fused_infer_attention_score_v2 if path == V2 else torch_npu.npu_fused_infer_attention_score


def max_workspace(path: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                  block_table: torch.Tensor, query_cu_lens: Sequence[int], kv_lens: Sequence[int], num_heads: int,
                  num_kv_heads: int, scale: float, sinks: torch.Tensor | None, sliding_window: int | None,
                  torch_npu: Any = None) -> torch.Tensor:
    """``_npu_fused_infer_attention_score(_v2)_get_max_workspace`` for the ``.out`` launch of :func:`relaunch_out`.

    The operator sizes the workspace for the worst case of the given shapes (docs/operators.md §3.7, §6; vllm-ascend
    passes it to every captured ``.out`` call and its updates). Host-side; returns a device uint8 tensor.
    """
    if torch_npu is None:
        import torch_npu as _tn

        torch_npu = _tn
    key, value, block_size = paged_views(key_cache, value_cache)
    kwargs = fia_kwargs(path, block_table=block_table, block_size=block_size, query_cu_lens=query_cu_lens,
                        kv_lens=kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, sinks=sinks,
                        sliding_window=sliding_window, mask=causal_template(torch.int8, query.device))
    fn = (torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace if path == V2
          else torch_npu._npu_fused_infer_attention_score_get_max_workspace)
    return fn(query, key, value, **kwargs)


#: Names of the (cumulative query, per-sequence KV) length arguments per path.
LENGTH_ARGS = {V2: ("actual_seq_qlen", "actual_seq_kvlen"), LSE: ("actual_seq_lengths", "actual_seq_lengths_kv")}


def relaunch_out(path: str, kwargs: dict[str, Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 out: torch.Tensor, softmax_lse: torch.Tensor, workspace: torch.Tensor | None,
                 query_cu_lens: list[int] | None = None, kv_lens: list[int] | None = None,
                 torch_npu: Any = None) -> torch.Tensor:
    """Exactly one ``.out`` launch of the fused operator of ``path`` (the task an ACL-graph task group holds) from its
    prepared :func:`fia_kwargs` (``key``/``value`` already the ``(num_blocks, block_size, KV_N*D)`` views of
    :func:`paged_views`), with new host-list lengths when given.

    ``v2``: ``npu_fused_infer_attention_score_v2.out(..., learnable_sink=sinks)`` - the finished result.
    ``lse``: ``npu_fused_infer_attention_score.out(..., softmax_lse_flag=sinks is not None)`` - attention *without*
    sinks and its LSE; the caller applies :func:`sink_rescale_` afterwards (outside the task group).

    The graph update's hot path: no argument is rebuilt, only the two length lists change (their names per path:
    :data:`LENGTH_ARGS`). Returns ``out``.
    """
    if torch_npu is None:
        import torch_npu as _tn

        torch_npu = _tn
    if query_cu_lens is not None:
        q_name, kv_name = LENGTH_ARGS[path]
        kwargs = {**kwargs, q_name: query_cu_lens, kv_name: kv_lens}
    _op(torch_npu, path).out(query, key, value, **kwargs, workspace=workspace, out=[out, softmax_lse])
    return out


def sink_rescale_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """In-place :func:`sink_rescale` of ``out`` (``(T, N, D)``) with ``lse`` ``(T, N, 1)`` float32; returns ``out``.

    Rows with KV length 0 have ``lse = +inf`` and output 0: ``0 · sigmoid(+inf) = 0``.
    """
    return out.copy_(sink_rescale(out, lse, sinks))
