"""Attention: keep GPT-OSS's learned attention sinks and route sink / sliding-window layers to fused operators.

Why
    vLLM's ``Attention`` passes ``sinks=<nn.Parameter [num_heads_per_rank]>`` to the backend impl
    (``vllm/attention/layer.py``: ``impl_cls(..., **extra_impl_args)``). vllm-ascend 0.11.0rc1 -
    0.14.0rc1 ``AscendAttentionBackendImpl.__init__`` ends with ``**kwargs`` and never reads it,
    so the sinks vanish and GPT-OSS attention silently computes a plain softmax
    (docs/upstream.md §7.1, §7.2; vllm-ascend issue #4283).
How
    A wrapt wrapper around ``AscendAttentionBackendImpl.__init__`` pops ``sinks`` from the
    keyword arguments, calls the original, validates the tensor and stores the *same object* as
    ``self.sinks`` (it is the model's parameter; the weight loader fills it later, so it must not be
    copied). Layers without sinks get ``self.sinks = None`` and run upstream's code unchanged.

    The forward patches route every layer that has sinks or a sliding window, in every attention state
    (PrefillNoCache, PrefillCacheHit, DecodeOnly, ChunkedPrefill, SpecDecoding), to
    :func:`gptoss_patch.kernels.attention.sink_window_attention`: one TND call over the paged KV cache that honours
    the sinks and the 128-key window, written into the ``output`` buffer vLLM passed in. Layers with neither sinks
    nor window take upstream's code unchanged.

    * 0.11.x (``attention.sink_window_forward``, on ``forward`` with ``trace_flag``): the traced call
      (``trace_flag=True``) goes to upstream unchanged, which re-enters ``forward`` through its custom op
      ``unified_ascend_attention_with_output`` with ``trace_flag=False``, where we write the KV cache and compute.
    * 0.12.0rc1 - 0.14.0rc1 (``attention.sink_window_forward_impl``, on ``forward_impl``): vLLM's own op
      ``unified_attention_with_output`` calls upstream's ``forward``, which writes the KV cache
      (``reshape_and_cache``) and calls ``forward_impl``; we compute there (the cache is not written twice; in
      PrefillNoCache the fresh K/V are already in the cache, so attending over the cache is exact). Upstream's own
      eager sliding-window decode (``_forward_decode_only`` / ``_forward_fia_slidingwindow``) returns a new tensor
      instead of writing the buffer vLLM reads (docs/upstream.md §7.2) - never reached for our layers.
    * 0.15.0rc1 - 0.18.0 (``attention.sink_window_forward_impl`` alone, layouts H and G): upstream takes the sinks
      itself (``__init__``'s ``sinks`` parameter, stored as ``self.sinks``) and keeps 0.12's ``forward`` ->
      ``forward_impl`` structure, but its sliding layers hand ``npu_fused_infer_attention_score_v2`` the band-shaped
      ``swa_mask`` with ``sparse_mode 4`` (not the template the operator requires; undocumented result) and
      ``pre_tokens = 128`` (129 keys; docs/upstream.md §4.3, §4.4). The same wrapper routes those layers to our call.
    * 0.19.1rc1 - 0.30.0rc2 (``attention.band_128_keys``, layouts I and J): upstream's sink path is right but for the
      band. Its impl uses ``self.sliding_window`` for nothing but the operator's ``pre_tokens`` (eager
      ``forward_fused_infer_attention``; from 0.20.2rc1 also the FULL_DECODE_ONLY capture ``full_graph_fia_v2`` and its
      per-step update, which copies the value into its parameters) and ``is not None`` / truth tests; with
      ``sparse_mode 4`` the band admits ``pre_tokens + 1`` keys (docs/operators.md §3.4). A wrapper around
      ``__init__`` stores ``sliding_window - 1`` (``kernels.attention.band``) on GPT-OSS's sliding layers, so every
      one of those calls attends GPT-OSS's 128 keys. Only while a GPT-OSS model is being built
      (:func:`gptoss_patch._state.building_gpt_oss`): other models keep upstream's value. tests/unit/
      test_reverse_drift.py reads every use of the window in each of these releases (``WINDOW_USES``).
Upstream releases
    vllm-ascend 0.11.0rc1 ... 0.14.0rc1 (layouts B, C, E, F in :mod:`gptoss_patch.matrix`): the first three. 0.15.0rc1
    added the ``sinks`` parameter natively; ``keep_sinks``' structural check refuses a target that already has it.
    0.15.0rc1 ... 0.18.0 (layouts H, G): ``sink_window_forward_impl``. 0.19.1rc1 ... 0.30.0rc2 (layouts I, J; PR #8387
    gave the sliding call the template in 0.19.1rc1): ``band_128_keys``.
Remove when
    upstream passes ``sliding_window - 1`` (or the oldest supported release does).
"""

from __future__ import annotations

from typing import Any

from gptoss_patch import evidence
from gptoss_patch.registry import PatchSpec


def validate_sinks(sinks: Any, num_heads: int, where: str) -> Any:
    """Check a GPT-OSS sink tensor and return it unchanged (same object).

    Args:
        sinks: ``torch.Tensor``/``nn.Parameter`` of shape ``[num_heads]`` (query heads on this
            tensor-parallel rank), floating dtype (bf16 in the checkpoints; fp16/fp32 accepted).
            One logit per query head, unscaled, joined to the softmax denominator
            (``docs/operators.md`` §3.5; transformers ``GptOssAttention``).
        num_heads: query heads per rank the impl was built with.
        where: description of the layer for the error message.

    Raises:
        TypeError: ``sinks`` is not a tensor or not floating point.
        ValueError: ``sinks`` is not 1-D of length ``num_heads``.
    """
    import torch

    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{where}: sinks must be a torch.Tensor of shape [{num_heads}], got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"{where}: sinks must be floating point (bfloat16 as in the GPT-OSS checkpoints), "
                        f"got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(f"{where}: sinks must have shape [{num_heads}] (query heads per tensor-parallel rank), "
                         f"got {list(sinks.shape)}")
    return sinks


def _keep_sinks(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendAttentionBackendImpl.__init__``: store ``sinks`` as ``self.sinks``.

    Also fixes the operator path for the process (:func:`gptoss_patch.kernels.attention.chosen_path`)
    when a layer has sinks, so a torch_npu that cannot honour sinks fails here, at model
    construction, with :class:`~gptoss_patch.kernels.attention.SinkAttentionUnavailable`.
    """
    sinks = kwargs.pop("sinks", None)
    result = wrapped(*args, **kwargs)
    if sinks is not None:
        where = (f"AscendAttentionBackendImpl(num_heads={instance.num_heads}, num_kv_heads={instance.num_kv_heads}, "
                 f"sliding_window={getattr(instance, 'sliding_window', None)})")
        sinks = validate_sinks(sinks, instance.num_heads, where)
        from gptoss_patch.kernels import attention as kernels

        kernels.chosen_path()
    instance.sinks = sinks
    return result


def _routes_to_us(impl: Any) -> bool:
    return getattr(impl, "sinks", None) is not None or getattr(impl, "sliding_window", None) is not None


def _forward_011(wrapped, instance, args, kwargs):
    """wrapt wrapper for 0.11.x ``AscendAttentionBackendImpl.forward(layer, query, key, value, kv_cache,
    attn_metadata, output=None, trace_flag=True)``.

    Shapes: ``query`` ``[T, N*D]`` (or ``[T, N, D]``), ``key``/``value`` ``[T, KV_N*D]``, ``kv_cache``
    ``(key_cache, value_cache)`` each ``[num_blocks, block_size, KV_N, D]``; ``output`` ``[T, N, D]``.
    Returns ``output.view(T, N*D)`` like upstream.
    """
    bound = _bind_011(*args, **kwargs)
    if bound["trace_flag"]:
        return wrapped(*args, **kwargs)
    layer = bound["layer"]
    if not _routes_to_us(instance):
        from gptoss_patch.patches.attention_graph import capture as graph_capture

        # upstream's code; under a full-graph capture its paged-attention record gets this layer's name
        return graph_capture.run_naming_upstream_records(lambda: getattr(layer, "layer_name", None),
                                                    lambda: wrapped(*args, **kwargs))
    evidence.first_use("attention", f"layer {getattr(layer, 'layer_name', '?')}")
    return sink_window_forward(instance, layer, bound["query"], bound["key"], bound["value"],
                               bound["kv_cache"], bound["attn_metadata"], bound["output"])


def _bind_011(layer, query, key, value, kv_cache, attn_metadata, output=None, trace_flag=True):
    return {"layer": layer, "query": query, "key": key, "value": value, "kv_cache": kv_cache,
            "attn_metadata": attn_metadata, "output": output, "trace_flag": trace_flag}


def _forward_impl(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendAttentionBackendImpl.forward_impl(query, key, value, kv_cache, attn_metadata,
    output)`` (vllm-ascend 0.12.0rc1 ... 0.18.0: layouts C, E, F, H, G).

    Upstream's ``forward`` (called by vLLM's ``unified_attention_with_output`` op, docs/upstream.md §7.1) has
    already returned zeros for ``attn_metadata is None``, written the new K/V into the paged cache
    (``reshape_and_cache``, which also sets ``impl.key_cache`` / ``impl.value_cache``) and taken the pooling branch;
    it then calls ``forward_impl`` and vLLM reads the ``output`` buffer afterwards (the return value is ignored).
    Layers with sinks or a window are computed here into ``output`` in every state
    (:func:`sink_window_attend`); the others run upstream's ``forward_impl`` unchanged (under a full-graph capture
    their records are named by layer: :func:`gptoss_patch.patches.attention_graph.capture.run_naming_upstream_records`).

    Shapes: ``query`` ``[T, N, D]``, ``key``/``value`` ``[T, KV_N, D]`` (the fresh tokens - already in the cache),
    ``output`` ``[T, N, D]``. Returns ``output``.
    """
    bound = _bind_forward_impl(*args, **kwargs)
    from gptoss_patch.patches.attention_graph import capture as graph_capture

    if not _routes_to_us(instance):
        return graph_capture.run_naming_upstream_records(lambda: graph_capture.layer_name_of(instance),
                                                    lambda: wrapped(*args, **kwargs))
    output = bound["output"]
    if output is None:
        raise ValueError("AscendAttentionBackendImpl.forward_impl: output buffer is None; vLLM >= 0.12 always "
                         "passes the [T, num_heads, head_size] buffer it reads afterwards")
    kv_cache = bound["kv_cache"]
    attn_metadata = bound["attn_metadata"]
    if attn_metadata is None or kv_cache is None or len(kv_cache) < 2:
        out3 = output.view(-1, instance.num_heads, instance.head_size)
        out3.fill_(0)  # no KV cache (profiling): like upstream's attn_metadata-is-None branch
        return output
    evidence.first_use("attention", f"layer {graph_capture.layer_name_of(instance)}")
    if instance.key_cache is None:  # set by upstream's reshape_and_cache; not called when key/value are None
        instance.key_cache, instance.value_cache = kv_cache[0], kv_cache[1]
    return sink_window_attend(instance, lambda: graph_capture.layer_name_of(instance), bound["query"], attn_metadata,
                              output)


def _bind_forward_impl(query, key, value, kv_cache, attn_metadata, output):
    return {"query": query, "key": key, "value": value, "kv_cache": kv_cache, "attn_metadata": attn_metadata,
            "output": output}


def sink_window_forward(impl: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                        attn_metadata: Any, output: Any) -> Any:
    """0.11.x: our attention for a layer with sinks and/or a sliding window, in any attention state.

    Writes the new K/V into the paged cache (``_npu_reshape_and_cache``, as upstream), then
    :func:`sink_window_attend`. With no KV cache (vLLM's profiling run) the output is zero-filled like
    upstream's ``attn_metadata is None`` branch.

    Raises:
        NotImplementedError: encoder / cross attention (GPT-OSS is decoder-only), or int8 KV cache.
        gptoss_patch.patches.attention_graph.capture.AclGraphCaptureError: a full-graph capture of a batch that is not DecodeOnly.
    """
    import torch
    import torch_npu

    num_tokens = query.shape[0]
    n, kvn, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    if output is None:
        output = torch.empty(num_tokens, n, d, dtype=query.dtype, device=query.device)
    out3 = output.view(-1, n, d)
    if attn_metadata is None or len(kv_cache) < 2:
        return out3.view(num_tokens, n * d).fill_(0)
    _check_supported(impl, kv_cache[0])
    k = key.view(-1, kvn, d)
    v = value.view(-1, kvn, d).contiguous()
    if impl.key_cache is None:
        impl.key_cache, impl.value_cache = kv_cache[0], kv_cache[1]
    num_actual = attn_metadata.num_actual_tokens
    torch_npu._npu_reshape_and_cache(key=k[:num_actual], value=v[:num_actual], key_cache=impl.key_cache,
                                     value_cache=impl.value_cache, slot_indices=attn_metadata.slot_mapping)
    sink_window_attend(impl, lambda: getattr(layer, "layer_name", None), query, attn_metadata, out3)
    return out3.view(num_tokens, n * d)


def _check_supported(impl: Any, key_cache: Any) -> None:
    import torch
    from vllm_ascend.attention.attention_v1 import AttentionType  # vLLM's, as that module imports it (it moved)

    if impl.attn_type != AttentionType.DECODER:
        raise NotImplementedError(f"gptoss-patch attention path supports decoder self-attention only, got "
                                  f"attn_type={impl.attn_type!r}")
    if key_cache is not None and key_cache.dtype == torch.int8:
        raise NotImplementedError("gptoss-patch attention path does not support an int8 KV cache")


def sink_window_attend(impl: Any, layer_name: Any, query: Any, attn_metadata: Any, output: Any) -> Any:
    """Sink / sliding-window attention of one layer over its paged KV cache (the new tokens already written).

    Computes the first ``actual_seq_lengths_q[-1]`` query rows with one fused call over the cache
    (:func:`gptoss_patch.kernels.attention.sink_window_attention`) and writes them into ``output`` (the buffer vLLM
    reads). A DecodeOnly batch padded to a graph size (fewer real tokens than rows) computes every row - padding rows
    are one-token sequences with KV length 0, i.e. zero rows - as the captured launch does, so eager and graph make
    the same launch and round identically. While a full ACL graph is being captured (FULL_DECODE_ONLY), the attention
    is captured instead as one updatable task over all ``T`` rows (:func:`gptoss_patch.patches.attention_graph.capture.capture_decode`).

    Metadata fields read (present in ``AscendMetadata`` of every supported release, docs/upstream.md §7.2):
    ``attn_state``, ``num_actual_tokens``, ``actual_seq_lengths_q`` (host list), ``seq_lens_list`` (host list),
    ``block_tables``. No device-to-host synchronisation.

    Args:
        impl: the ``AscendAttentionBackendImpl`` (``key_cache``/``value_cache`` set, ``[num_blocks, block_size,
            KV_N, D]``; ``sinks`` ``[N]`` or None; ``sliding_window`` or None).
        layer_name: callable returning the vLLM layer name (only asked for under a capture).
        query: ``[T, N*D]`` or ``[T, N, D]``; output: ``[T, N, D]`` (or a view of it), written in place.

    Returns:
        ``output``.

    Raises:
        NotImplementedError: encoder / cross attention, or int8 KV cache.
        gptoss_patch.patches.attention_graph.capture.AclGraphCaptureError: a full-graph capture of a batch that is not DecodeOnly.
    """
    from gptoss_patch.kernels import attention as kernels
    from gptoss_patch.patches.attention_graph import capture as graph_capture
    from gptoss_patch.patches.attention_graph import update as aclgraph

    _check_supported(impl, impl.key_cache)
    num_tokens = query.shape[0]
    n, d = impl.num_heads, impl.head_size
    q = query.view(-1, n, d)
    out3 = output.view(-1, n, d)
    if graph_capture.capturing():  # FULL_DECODE_ONLY capture: one updatable launch over all T rows
        graph_capture.capture_decode(impl, layer_name(), q, out3, attn_metadata,
                                     check_update=aclgraph.check_update_patched)
        return output
    # Host lists (no device sync).
    q_cu = attn_metadata.actual_seq_lengths_q
    kv_lens = attn_metadata.seq_lens_list
    num_actual = attn_metadata.num_actual_tokens
    rows = min(num_tokens, attn_metadata.block_tables.shape[0])
    if attn_metadata.attn_state == _decode_only() and num_actual < rows:
        # Padded decode batch (PIECEWISE, or a full-graph size run eagerly): cover every row like the captured
        # launch does (padding rows = one-token sequences with KV length 0 -> zero rows).
        q_cu, kv_lens = kernels.decode_launch_lengths(q_cu, kv_lens, num_actual, rows)
    batch = len(q_cu)
    used = q_cu[-1]
    kernels.sink_window_attention(
        q[:used], impl.key_cache, impl.value_cache, block_table=attn_metadata.block_tables[:batch],
        query_cu_lens=q_cu, kv_lens=kv_lens[:batch], num_heads=n, num_kv_heads=impl.num_kv_heads,
        scale=impl.scale, sinks=impl.sinks, sliding_window=impl.sliding_window, out=out3[:used])
    return output


def _band_128_keys(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``AscendAttentionBackendImpl.__init__`` (vllm-ascend 0.19.1rc1 - 0.30.0rc2, layouts I, J).

    Builds the impl, then, on a GPT-OSS sliding layer (while :data:`gptoss_patch._state.gpt_oss_building`, with a
    window and sinks), stores the operator's ``pre_tokens`` for that window as ``self.sliding_window``:
    ``window - 1`` (127 for GPT-OSS's 128 keys; :func:`gptoss_patch.kernels.attention.band`), because on every path
    a layer with sinks can take in these releases the attribute is ``pre_tokens=`` of a ``sparse_mode 4`` call or a
    None / truth test (module docstring; 0.19.1rc1's sink-less BSH decode ``_forward_fia_slidingwindow`` is never
    reached with sinks). The model's window stays readable as ``self.gptoss_window``. Other layers are untouched.

    Raises:
        ValueError: a GPT-OSS window below 2 (``pre_tokens`` 0 would read as "no window" in upstream's truth tests;
            GPT-OSS's is 128).
    """
    result = wrapped(*args, **kwargs)
    from gptoss_patch import _state

    window = getattr(instance, "sliding_window", None)
    if _state.gpt_oss_building and window is not None and getattr(instance, "sinks", None) is not None:
        from gptoss_patch.kernels.attention import band

        if window < 2:
            raise ValueError(f"GPT-OSS sliding_window must be >= 2 for the fused band (pre_tokens = window - 1 > 0), "
                             f"got {window}; GPT-OSS's config.json has 128")
        instance.gptoss_window = window
        instance.sliding_window = band(window)[1]
    return result


def band_problems(model: Any) -> list[str]:
    """GPT-OSS sliding layers of a built model whose impl is not on GPT-OSS's band (layouts I, J; the guard's check
    after the build, :func:`gptoss_patch.patches.guard.check_runs`).

    Every attention impl with sinks and a window (``impl.sliding_window`` not None) must hold the model's window
    (``model.config.sliding_window``, 128) as ``gptoss_window`` and ``window - 1`` as ``sliding_window``: an impl built
    outside the guard's build (the flag unset), or a window vLLM passed otherwise than the config's, is named.

    Args:
        model: the built ``GptOssForCausalLM`` (``named_modules()``; vLLM's attention layers hold the impl as
            ``impl``; ``config`` the HF config).

    Returns:
        One line per layer off the band; empty when every sliding layer is on it.
    """
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if window is None or not hasattr(model, "named_modules"):
        return []
    problems = []
    for name, sub in model.named_modules():
        impl = getattr(sub, "impl", None)
        if impl is None or getattr(impl, "sinks", None) is None or getattr(impl, "sliding_window", None) is None:
            continue
        got = (getattr(impl, "gptoss_window", None), impl.sliding_window)
        if got != (window, window - 1):
            problems.append(f"attention.band_128_keys: layer {name} holds sliding_window {impl.sliding_window} "
                            f"(gptoss_window {got[0]}) where GPT-OSS's {window}-key band needs pre_tokens "
                            f"{window - 1}: its fused calls would attend {impl.sliding_window + 1} keys")
    return problems


def _decode_only() -> Any:
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    return AscendAttentionState.DecodeOnly


PATCHES = [
    PatchSpec(
        name="attention.keep_sinks",
        target_key="attention_impl_init",
        wrapper=_keep_sinks,
        params=("num_heads", "head_size", "scale", "num_kv_heads", "sliding_window", "**"),
        absent_params=("sinks",),
        summary="AscendAttentionBackendImpl keeps the GPT-OSS attention sinks as self.sinks",
    ),
    PatchSpec(
        name="attention.sink_window_forward",
        target_key="attention_impl_forward_011",
        wrapper=_forward_011,
        params=("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "trace_flag"),
        summary="layers with sinks or a sliding window run fused TND attention with sinks and a 128-key band",
        traced=True,  # vLLM 0.11's compiled forward calls it with trace_flag=True (PIECEWISE graph mode)
    ),
    PatchSpec(
        name="attention.sink_window_forward_impl",
        target_key="attention_impl_forward_impl",
        wrapper=_forward_impl,
        params=("query", "key", "value", "kv_cache", "attn_metadata", "output"),
        summary="layers with sinks or a sliding window run fused TND attention with sinks and a 128-key band, "
                "written into vLLM's output buffer",
    ),
    PatchSpec(
        name="attention.band_128_keys",
        target_key="attention_impl_init",
        wrapper=_band_128_keys,
        params=("sliding_window", "sinks"),
        defect_present=("self.sliding_window = sliding_window",),
        defect_absent=("sliding_window - 1",),
        summary="GPT-OSS's sliding layers hand upstream's fused calls pre_tokens = window - 1: 128 keys, not 129",
    ),
]
