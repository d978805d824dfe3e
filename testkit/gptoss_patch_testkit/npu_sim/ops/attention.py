"""Attention operators of the simulated ``torch_npu``: fused infer attention (v1, v2 with sinks) and the ATB ops.

The family
    vllm-ascend computes attention with two groups of torch_npu operators
    (``docs/operators.md`` §3, §3.7):

    * **FIA** - ``npu_fused_infer_attention_score`` (v1) and ``npu_fused_infer_attention_score_v2``
      (renamed arguments plus ``learnable_sink``), each with an ``.out`` overload used under NPU-graph
      capture and a ``_..._get_max_workspace`` helper. One operator dispatches to two CANN kernels: the
      *decode* kernel (IFA) when the layout is not TND and the query has one token per batch, else the
      *prefill* kernel (PFA); TND always runs the prefill kernel (docs/operators.md §3.2; OTX-fiat ``IsUsingIFA``).
      The kernel matters for masking: PFA obeys ``sparse_mode`` (geometry of docs/operators.md §3.3), IFA ignores it but
      turns ``pre_tokens`` into a sliding window for BSH + paged KV (OTX-ifa ``slidingFlag_``).
    * **ATB** - ``_npu_flash_attention`` (packed prefill, explicit mask), ``_npu_flash_attention_qlens``
      (prefill over a paged prefix), ``_npu_paged_attention`` (+ ``_get_workspace``, decode) and
      ``_npu_reshape_and_cache`` (scatter new K/V into the paged cache). They return nothing and write into
      their ``out``/cache arguments (OPC-atb schemas).

Reference computation (docs/operators.md §3.1, §3.5), per batch ``b``, query head ``n``, KV head
``g = n // (Q_N / KV_N)`` (docs/operators.md §3.1), allowed key set ``A(i)`` from the masking rules::

    s[i, j] = scale * <q[i, n], k[j, g]>                          (float32)
    m_i     = max_{j in A(i)} s[i, j]
    Z_i     = sum_{j in A(i)} exp(s[i, j] - m_i)
    out[i]  = sum_{j in A(i)} exp(s[i, j] - m_i) v[j, g] / (Z_i + [sink] exp(sink[n] - m_i))
    lse[i]  = m_i + ln Z_i

Everything is computed in float32 and the output is cast to the query dtype (docs/operators.md §2). Rows with no allowed
key (including KV length 0) are 0, their LSE is ``+inf``.

Choices where the sources are silent or the simulator deliberately differs (each also stated where it applies):

* **float32 inputs** are accepted as a *simulator extension* (the real operators take fp16/bf16 only,
  OPD-fia ``query``) so that tests can compare exactly against a float32/float64 reference. Set
  :data:`ACCEPT_FLOAT32` to ``False`` to get the real operator's dtype error.
* **softmax_lse with a learnable sink excludes the sink term**: ``lse = m + ln(sum_{j in A} exp(s - m))``.
  docs/operators.md §3.5 marks this UNVERIFIED; the PFA kernel source (OTX-pfa
  ``prompt_flash_attention_s1s2_bns1_mla_baseapi.h``) writes the LSE from the softmax row sum in the
  vector-1 stage of the last KV loop, and only later, in ``Bmm2ResultDiv`` (vector-2 stage of the same
  loop), adds ``exp(sink - rowmax)`` to that sum before dividing. Consequently
  ``out * (1 + exp(sink - lse)) == sum_j exp(s_j - lse) v_j`` holds exactly.
* **LSE of rows with no allowed key** is ``+inf``: the same kernel overwrites invalid rows' LSE with
  ``3e+99`` (``AdjustSoftMaxRes``), which is ``+inf`` in float32.
* **When not requested**, the functional ``softmax_lse`` is a float32 tensor of shape ``(1,)`` filled with 0
  (OPD-fia "output shape [1] with value 0"; the meta function says ``(0,)``, OPMETA), and the ``.out``
  overload leaves its ``softmax_lse`` buffer untouched.
* **TND rows beyond the last cumulative query length do not exist**: both the FIA tiling
  (OTX ``fused_infer_attention_score_tiling_check_feature.cpp``, "T should be equal to the last element of
  actual_seq_lengths") and the PFA TND check (OTX-pfat ``CheckInputShapeWhenLayoutIsTND``) reject
  ``T != actual_seq_lengths[-1]``; so does this simulator (RuntimeError), for the functional and the
  ``.out`` form alike. vllm-ascend slices ``query[:num_tokens]`` (eager) or pads the lengths (graph) for
  exactly this reason (VA@v0.11.0 ``forward``: "does not support cases where query.shape[0] !=
  query_start_loc[-1]").
* In BSH/BSND/BNSD, query rows beyond a batch's ``actual_seq_lengths`` are written as 0 (UNVERIFIED).
* **Mask templates** for ``sparse_mode`` 2/3/4 (and the ATB qlens compressed mask) must have the template
  *content* (nonzero exactly above the diagonal), not just the documented shape. The real tiling cannot
  read device data, so a wrong template silently produces wrong geometry on hardware (vllm-ascend
  v0.15.0rc1 passed a sliding-window mask with mode 4, fixed by PR #8387); the simulator makes it loud.
* Unimplemented optional features (quantisation, pse, rope, shared prefix, padding sizes, the NTD
  layouts) raise :class:`~gptoss_patch_testkit.npu_sim._base.NotEmulatedError`; invalid inputs raise
  ``RuntimeError`` naming the argument, as the real operators do.

Performance
    One vectorised computation per batch (sequence): all heads at once through ``bmm`` on a
    ``(KV_N, G*rows, D)`` view, query rows chunked so a score block stays under 32 MiB, and keys outside the
    union of a chunk's allowed band skipped (decode rows of a 128-window read 128 keys, not the whole
    sequence). Paged blocks are gathered with ``torch.cat`` of block views (``index_select`` stalls with two
    OpenMP threads on a loaded host). Roughly 0.1 s per GPT-OSS-120b layer of ~300 tokens on one core.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from gptoss_patch_testkit.npu_sim._base import NotEmulatedError, with_out

__all__ = [
    "OPS",
    "ACCEPT_FLOAT32",
    "ACCEPT_STRIDED_QKV",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_reshape_and_cache",
    "_npu_flash_attention",
    "_npu_flash_attention_qlens",
    "_npu_paged_attention",
    "_npu_paged_attention_get_workspace",
]

#: Default of ``pre_tokens`` / ``next_tokens`` (OPY72 schema).
INT_MAX = 2147483647

#: Simulator extension: accept float32 query/key/value (and sinks, masks of the ATB ops) so that tests can
#: compare exactly against a float32 reference. The real operators accept fp16/bf16 only (OPD-fia
#: ``query``; ATB SelfAttention/PagedAttention docs). Set to ``False`` for the real dtype check.
ACCEPT_FLOAT32: bool = True

#: Accept strided (non-contiguous) query/key/value in the fused attention operators and compute on their values.
#: The op-plugin pages say "不支持非连续的Tensor" (non-contiguous not supported) for each of the three (OPD-fia,
#: OPD-fia2), but vllm-ascend 0.17.0rc1 - 0.19.1rc1 hand ``npu_fused_infer_attention_score(_v2)`` a strided ``value``
#: (and ``key``) in every PrefillNoCache batch of a model with a fused QKV projection - the ``value[:num_tokens]`` view
#: of that projection's output (``attention_v1.py`` ``forward_fused_infer_attention``) - and those releases run on
#: hardware; and
#: served that way, 0.19.1rc1 reproduces transformers with its documented band exactly (docs/simulator.md). So the
#: device takes them; whether op-plugin or the aclnn framework copies them to a contiguous buffer is UNVERIFIED
#: (op-plugin hands aclnn the tensor's strides). ``False`` restores the pages' refusal. A non-contiguous
#: ``atten_mask`` is still refused (no release passes one).
ACCEPT_STRIDED_QKV: bool = True

#: Size in bytes of the workspace tensors returned by the ``_get_*workspace`` helpers. On the NPU this is
#: the tiling's workspace size; on the CPU no workspace is used, so the size is not meaningful.
WORKSPACE_BYTES = 64

_INF = float("inf")
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_MAX_SCORE_ELEMENTS = 1 << 23  # float32 score elements per chunk (32 MiB) in _attend
_KNOWN_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")
_NOT_EMULATED_LAYOUTS = ("TND_NTD", "NTD_TND", "NTD", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "BSH_BNSD",
                         "BSND_BNSD", "SBH")


# --------------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------------

def _fail(op: str, msg: str) -> None:
    raise RuntimeError(f"{op}: {msg}")


def _compute_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float16, torch.bfloat16, torch.float32) if ACCEPT_FLOAT32 else (torch.float16, torch.bfloat16)


def _check_float_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _compute_dtypes():
        ext = " (or float32, a simulator extension)" if ACCEPT_FLOAT32 else ""
        _fail(op, f"{name} must be float16 or bfloat16{ext}, got {t.dtype}")


def _check_tensor(op: str, name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_contiguous(op: str, name: str, t: Optional[torch.Tensor]) -> None:
    if t is not None and not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (non-contiguous tensors are not supported), got shape "
                  f"{list(t.shape)} with strides {list(t.stride())}")


def _as_lengths(op: str, name: str, x: Any) -> Optional[list[int]]:
    """A length list given as a Python sequence of ints or a 1-D integer tensor (CPU) -> list[int] (or None)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            _fail(op, f"{name} must hold integers, got a {x.dtype} tensor")
        if x.dim() != 1:
            _fail(op, f"{name} must be 1-D, got shape {list(x.shape)}")
        return [int(v) for v in x.tolist()]
    if isinstance(x, (list, tuple)):
        out = []
        for v in x:
            if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_floating_point:
                v = int(v.item())
            try:
                out.append(operator.index(v))
            except TypeError:
                _fail(op, f"{name} must hold integers, got {type(v).__name__} {v!r}")
        return out
    _fail(op, f"{name} must be a list of ints or an integer tensor, got {type(x).__name__}")
    return None  # unreachable


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            allowed: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
            sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one batch, all heads at once (the formula in the module docstring).

    Args:
        q: ``(Sq, N, D)`` float32.
        k: ``(Skv, KV_N, D)`` float32; query head ``n`` reads KV head ``n // (N / KV_N)``.
        v: ``(Skv, KV_N, Dv)`` float32.
        scale: multiplier of ``q.k``.
        allowed: bool ``(Sq, Skv)``, True = attend; None = every key.
        bias: float32 ``(Sq, Skv)`` added to the scaled scores (ATB additive masks; ``-inf`` = masked).
        sink: float32 ``(N,)`` unscaled extra logit per head, in the denominator only.

    Returns:
        ``out (Sq, N, Dv)`` float32 (0 for rows without an allowed key) and ``lse (Sq, N)`` float32
        (``+inf`` for such rows; excludes the sink).
    """
    sq, n, d = q.shape
    skv, kvn, _ = k.shape
    dv = v.shape[2]
    out = q.new_zeros((sq, n, dv))
    lse = q.new_full((sq, n), _INF)
    if sq == 0 or skv == 0:
        return out, lse
    g = n // kvn
    kt_all = k.permute(1, 2, 0)  # (KVN, D, Skv)
    v_all = v.permute(1, 0, 2)  # (KVN, Skv, Dv)
    sk = None if sink is None else sink.reshape(kvn, g, 1, 1)
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, n * skv))
    for s0 in range(0, sq, step):
        s1 = min(sq, s0 + step)
        c = s1 - s0
        # keys outside [lo, hi) are masked for every row of the chunk: skip them (pure speed-up)
        lo, hi = 0, skv
        a_c = None if allowed is None else allowed[s0:s1]
        if a_c is not None:
            cols = a_c.any(dim=0).nonzero()
            if cols.numel() == 0:
                continue  # no row of the chunk attends anything: zeros / +inf already in place
            lo, hi = int(cols[0, 0]), int(cols[-1, 0]) + 1
            a_c = a_c[:, lo:hi]
        w = hi - lo
        qc = q[s0:s1].reshape(c, kvn, g, d).permute(1, 2, 0, 3).reshape(kvn, g * c, d)
        s = torch.bmm(qc, kt_all[:, :, lo:hi]).mul_(scale).view(kvn, g, c, w)  # (KVN, G, c, w)
        if bias is not None:
            s.add_(bias[s0:s1, lo:hi])
        if a_c is not None:
            s.masked_fill_(~a_c, -_INF)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = s.sub_(m).exp_()  # in place: s is a fresh buffer
        z = p.sum(dim=-1, keepdim=True)
        pv = torch.bmm(p.view(kvn, g * c, w), v_all[:, lo:hi]).view(kvn, g, c, dv)
        denom = z if sk is None else z + torch.exp(sk - m)
        has = z > 0
        o = torch.where(has, pv / torch.where(has, denom, torch.ones_like(denom)), torch.zeros((), dtype=q.dtype))
        l_ = torch.where(has, m + torch.log(torch.where(has, z, torch.ones_like(z))),
                         torch.full((), _INF, dtype=q.dtype))
        out[s0:s1] = o.permute(2, 0, 1, 3).reshape(c, n, dv)
        lse[s0:s1] = l_.squeeze(-1).permute(2, 0, 1).reshape(c, n)
    return out, lse


#: Variable naming operator deviations to *inject* (comma-separated), for tests that must see a numerical check
#: fail: ``band129`` - ``sparse_mode 4`` admits one key more than documented (``pre_tokens + 2``: the band
#: ``pre_tokens=127`` then holds 129 keys, as a CANN release with an off-by-one band would; docs/operators.md
#: "Sliding-window band"); ``drop_sink`` - ``learnable_sink`` is accepted and ignored (an op-plugin that lacks
#: it). Read at every call; unknown names raise ``ValueError``. Never set outside tests (docs/simulator.md).
from gptoss_patch_testkit import config as _config  # noqa: E402

FAULT_ENV = _config.SIM_FAULT
FAULTS = _config.VARIABLES[FAULT_ENV].choices


def _faults() -> frozenset:
    """The deviations injected through :data:`FAULT_ENV` (empty normally).

    Raises:
        ValueError: a name that is not in :data:`FAULTS`.
    """
    return _config.names(FAULT_ENV)


def _rel(sq: int, skv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(sq).unsqueeze(1), torch.arange(skv).unsqueeze(0)


def _band(sq: int, skv: int, lo: int, hi: int) -> torch.Tensor:
    """bool ``(sq, skv)``: allowed iff ``i + lo <= j <= i + hi``."""
    i, j = _rel(sq, skv)
    return (j >= i + lo) & (j <= i + hi)


_template_ok_cache: dict[tuple, bool] = {}


def _is_causal_template(mask: torch.Tensor) -> bool:
    """True when ``mask`` (2-D view) is nonzero exactly above the diagonal (``triu(ones, 1)``), cached per buffer."""
    m2 = mask.reshape(mask.shape[-2], mask.shape[-1])
    # inference-mode tensors keep no version counter (and cannot be modified outside inference mode)
    version = -1 if m2.is_inference() else m2._version
    key = (m2.data_ptr(), version, tuple(m2.shape), tuple(m2.stride()), m2.dtype)
    hit = _template_ok_cache.get(key)
    if hit is not None:
        return hit
    side_r, side_c = m2.shape
    i, j = _rel(side_r, side_c)
    ok = bool(torch.equal(m2 != 0, j > i))
    if len(_template_ok_cache) > 64:
        _template_ok_cache.clear()
    _template_ok_cache[key] = ok
    return ok


def _gather_paged(op: str, cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int,
                  kvn: int, heads_major: bool, b: int) -> torch.Tensor:
    """Logical KV rows ``0..length-1`` of one sequence as ``(length, KV_N, D)`` float32 (docs/operators.md §3.7).

    ``heads_major``: cache is ``(num_blocks, KV_N, block_size, D)``; else ``(num_blocks, block_size, KV_N*D)``
    or ``(num_blocks, block_size, KV_N, D)``.
    """
    if length == 0:
        return cache.new_zeros((0, kvn, 1), dtype=torch.float32)
    nblk = -(-length // block_size)
    ids = table_row[:nblk].tolist()
    num_blocks = cache.shape[0]
    for j, i in enumerate(ids):
        if not 0 <= i < num_blocks:
            _fail(op, f"block_table[{b}, {j}] = {i} is not a block of the KV cache (num_blocks={num_blocks})")
    # torch.cat of block views: index_select is pathologically slow with 2 threads on a loaded host
    c = torch.cat([cache[i].unsqueeze(0) for i in ids]) if nblk > 1 else cache[ids[0]].unsqueeze(0)
    if heads_major:
        c = c.permute(0, 2, 1, 3)
    return c.reshape(nblk * block_size, kvn, -1)[:length].to(torch.float32)


# --------------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score (v1) / _v2
# --------------------------------------------------------------------------------------------------

@dataclass
class _Fia:
    """Normalised arguments of one FIA call (v1 and v2 map onto this)."""

    op: str
    names: dict[str, str]  # canonical field -> the caller's argument name (for messages)
    query: Any
    key: Any
    value: Any
    atten_mask: Any
    qlens: Any
    kvlens: Any
    block_table: Any
    num_heads: int
    scale: float
    pre_tokens: int
    next_tokens: int
    input_layout: str
    num_kv_heads: int
    sparse_mode: int
    inner_precise: int
    block_size: int
    want_lse: bool
    sink: Any = None


_V1_NAMES = {"qlens": "actual_seq_lengths", "kvlens": "actual_seq_lengths_kv", "num_heads": "num_heads",
             "scale": "scale", "want_lse": "softmax_lse_flag"}
_V2_NAMES = {"qlens": "actual_seq_qlen", "kvlens": "actual_seq_kvlen", "num_heads": "num_query_heads",
             "scale": "softmax_scale", "want_lse": "return_softmax_lse"}


def _reject_unsupported(op: str, **kwargs: Any) -> None:
    for name, val in kwargs.items():
        if val is not None:
            raise NotEmulatedError(f"torch_npu.{op}: argument {name} is not emulated by gptoss_patch_testkit.npu_sim "
                                   "(only the non-quantised, pse-/rope-/prefix-free path vllm-ascend uses for GPT-OSS)")


def _v1_args(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
             actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
             quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
             key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
             value_antiquant_offset=None, block_table=None, query_padding_size=None, kv_padding_size=None,
             key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
             key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
             next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
             block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
             softmax_lse_flag=False):
    op = "npu_fused_infer_attention_score"
    _reject_unsupported(op, pse_shift=pse_shift, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
                        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
                        antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                        key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
                        value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
                        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
                        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
                        actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
                        key_rope_antiquant_scale=key_rope_antiquant_scale)
    return _Fia(op, _V1_NAMES, query, key, value, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                block_table, num_heads, scale, pre_tokens, next_tokens, input_layout, num_key_value_heads,
                sparse_mode, inner_precise, block_size, softmax_lse_flag)


def _v2_args(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
             actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
             dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
             dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None, learnable_sink=None,
             num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX,
             next_tokens=INT_MAX, input_layout="BSH", sparse_mode=0, block_size=0, query_quant_mode=0,
             key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False, query_dtype=None,
             key_dtype=None, value_dtype=None, query_rope_dtype=None, key_rope_dtype=None,
             key_shared_prefix_dtype=None, value_shared_prefix_dtype=None, dequant_scale_query_dtype=None,
             dequant_scale_key_dtype=None, dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None,
             quant_scale_p=None, out_dtype=None):
    op = "npu_fused_infer_attention_score_v2"
    _reject_unsupported(op, query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift,
                        dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
                        dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
                        dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
                        quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, query_dtype=query_dtype,
                        key_dtype=key_dtype, value_dtype=value_dtype, query_rope_dtype=query_rope_dtype,
                        key_rope_dtype=key_rope_dtype, key_shared_prefix_dtype=key_shared_prefix_dtype,
                        value_shared_prefix_dtype=value_shared_prefix_dtype,
                        dequant_scale_query_dtype=dequant_scale_query_dtype,
                        dequant_scale_key_dtype=dequant_scale_key_dtype,
                        dequant_scale_value_dtype=dequant_scale_value_dtype,
                        dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype, quant_scale_p=quant_scale_p,
                        out_dtype=out_dtype)
    return _Fia(op, _V2_NAMES, query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                num_query_heads, softmax_scale, pre_tokens, next_tokens, input_layout, num_key_value_heads,
                sparse_mode, inner_precise, block_size, return_softmax_lse, learnable_sink)


@dataclass
class _Job:
    """One batch: where its query rows are and how to get its K/V and allowed set."""

    b: int
    sq: int
    skv: int
    q_rows: tuple  # index into the normalised query/output (TND: (start, end); else (b, sq))
    kv_src: tuple  # ("pa", table_row) | ("tnd", start, end) | ("dense", b)


@dataclass
class _Plan:
    a: _Fia
    layout: str
    n: int
    kvn: int
    d: int
    dv: int
    ifa: bool
    jobs: list
    out_shape: tuple
    lse_shape: tuple
    paged: bool
    heads_major: bool
    sliding: bool
    sink: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]


def _fia_prepare(a: _Fia) -> _Plan:  # noqa: C901 - one validation routine per documented rule
    op, nm = a.op, a.names
    q = _check_tensor(op, "query", a.query)
    k = _check_tensor(op, "key", a.key)
    v = _check_tensor(op, "value", a.value)
    layout = a.input_layout
    if layout in _NOT_EMULATED_LAYOUTS:
        raise NotEmulatedError(f"torch_npu.{op}: input_layout={layout!r} is not emulated "
                               f"(emulated: {', '.join(_KNOWN_LAYOUTS)})")
    if layout not in _KNOWN_LAYOUTS:
        _fail(op, f"input_layout={layout!r} is not a supported layout")
    _check_float_dtype(op, "query", q)
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            _fail(op, f"{name} dtype {t.dtype} must equal the query dtype {q.dtype} (non-quantised path)")
    if not ACCEPT_STRIDED_QKV:
        for name, t in (("query", q), ("key", k), ("value", v)):
            _check_contiguous(op, name, t)
    _check_contiguous(op, "atten_mask", a.atten_mask)
    if a.inner_precise not in (0, 1, 2, 3):
        _fail(op, f"inner_precise must be 0, 1, 2 or 3, got {a.inner_precise}")

    n = int(a.num_heads)
    if n <= 0 or n > 256:
        _fail(op, f"{nm['num_heads']} must be in [1, 256], got {n}")
    kvn = int(a.num_kv_heads) or n
    if kvn <= 0 or kvn > 256:
        _fail(op, f"num_key_value_heads must be in [0, 256], got {a.num_kv_heads}")
    if n % kvn != 0:
        _fail(op, f"{nm['num_heads']} ({n}) must be a multiple of num_key_value_heads ({kvn})")
    if n // kvn > 64:
        _fail(op, f"{nm['num_heads']} / num_key_value_heads = {n // kvn} must not exceed 64")

    paged = a.block_table is not None
    tnd = layout == "TND"

    # ---- query shape ---------------------------------------------------------------------------
    if tnd:
        if q.dim() != 3:
            _fail(op, f"query must be 3-D (T, N, D) for input_layout TND, got shape {list(q.shape)}")
        if q.shape[1] != n:
            _fail(op, f"query N dim ({q.shape[1]}) must equal {nm['num_heads']} ({n})")
        d = q.shape[2]
        s_q = None
        bsz = None
    elif layout == "BSH":
        if q.dim() != 3:
            _fail(op, f"query must be 3-D (B, S, H) for input_layout BSH, got shape {list(q.shape)}")
        if q.shape[2] % n != 0:
            _fail(op, f"query H ({q.shape[2]}) must be a multiple of {nm['num_heads']} ({n})")
        bsz, s_q, d = q.shape[0], q.shape[1], q.shape[2] // n
    else:
        if q.dim() != 4:
            _fail(op, f"query must be 4-D for input_layout {layout}, got shape {list(q.shape)}")
        if layout == "BSND":
            bsz, s_q, qn, d = q.shape
        else:
            bsz, qn, s_q, d = q.shape
        if qn != n:
            _fail(op, f"query N dim ({qn}) must equal {nm['num_heads']} ({n})")
    if d % 16 != 0 or d <= 0:
        _fail(op, f"query head dim D={d} must be a positive multiple of 16 for float16/bfloat16 inputs")
    if d > 512:
        _fail(op, f"query head dim D={d} must not exceed 512")
    if bsz is not None and bsz > 65536:
        _fail(op, f"query batch B={bsz} must not exceed 65536")
    if layout in ("BSH", "BSND") and n * d >= 65535:
        _fail(op, f"{nm['num_heads']} * D = {n * d} must be less than 65535 for input_layout {layout}")
    ifa = (not tnd) and s_q == 1
    if layout == "BNSD_BSND" and s_q == 1:
        _fail(op, "input_layout BNSD_BSND supports only Q_S > 1")

    # ---- key / value shape ---------------------------------------------------------------------
    heads_major = False
    if paged:
        bt = _check_tensor(op, "block_table", a.block_table)
        if bt.dim() != 2:
            _fail(op, f"block_table must be 2-D (B, max_blocks_per_seq), got shape {list(bt.shape)}")
        if bt.dtype != torch.int32:
            _fail(op, f"block_table must be int32, got {bt.dtype}")
        if k.dim() != v.dim() or k.shape[:2] != v.shape[:2]:
            _fail(op, f"key {list(k.shape)} and value {list(v.shape)} paged caches must have the same layout, "
                      "num_blocks and block dims")
        if k.dim() == 3:
            num_blocks, cache_bs, kh = k.shape
            if kh % kvn != 0 or v.shape[2] % kvn != 0:
                _fail(op, f"key/value cache hidden size ({kh}, {v.shape[2]}) must be a multiple of "
                          f"num_key_value_heads ({kvn})")
            dk, dv = kh // kvn, v.shape[2] // kvn
            if kvn * dk > 65535:
                _fail(op, f"paged KV cache (num_blocks, block_size, KV_N*D) with KV_N*D={kvn * dk} > 65535 is "
                          "not supported; use (num_blocks, KV_N, block_size, D)")
        elif k.dim() == 4:
            if layout not in ("BNSD", "BNSD_BSND", "TND"):
                _fail(op, f"input_layout {layout} accepts only the 3-D paged KV cache (num_blocks, block_size, "
                          f"KV_N*D); got key shape {list(k.shape)}")
            num_blocks, ckvn, cache_bs, dk = k.shape
            if ckvn != kvn or v.shape[1] != kvn:
                _fail(op, f"key/value cache KV_N dim ({ckvn}, {v.shape[1]}) must equal num_key_value_heads ({kvn})")
            if v.shape[2] != cache_bs:
                _fail(op, f"value cache block dim {v.shape[2]} must equal the key cache's {cache_bs}")
            dv = v.shape[3]
            heads_major = True
        else:
            _fail(op, f"paged key/value cache must be 3-D (num_blocks, block_size, KV_N*D) or 4-D "
                      f"(num_blocks, KV_N, block_size, D), got key shape {list(k.shape)}")
        if v.shape[0] != num_blocks:
            _fail(op, f"key and value caches must have the same num_blocks ({num_blocks} vs {v.shape[0]})")
        bs = int(a.block_size)
        if bs <= 0:
            _fail(op, f"block_size must be set (> 0) when block_table is given, got {a.block_size}")
        if bs != cache_bs:
            _fail(op, f"block_size ({bs}) must equal the KV cache block dim ({cache_bs})")
        if tnd:
            if bs % 16 != 0 or bs > 1024:
                _fail(op, f"block_size ({bs}) must be a multiple of 16 and <= 1024 for input_layout TND")
        elif ifa:
            if bs > 512:
                _fail(op, f"block_size ({bs}) must be <= 512 when Q_S = 1")
        else:
            if bs < 128 or bs > 512 or bs % 128 != 0:
                _fail(op, f"block_size ({bs}) must be a multiple of 128 in [128, 512] when Q_S > 1 in "
                          f"input_layout {layout}")
    else:
        bt = None
        bs = 0
        if tnd:
            if k.dim() != 3 or v.dim() != 3:
                _fail(op, f"key/value must be 3-D (T_kv, KV_N, D) for input_layout TND, got {list(k.shape)}, "
                          f"{list(v.shape)}")
            if k.shape[1] != kvn or v.shape[1] != kvn:
                _fail(op, f"key/value N dim ({k.shape[1]}, {v.shape[1]}) must equal num_key_value_heads ({kvn})")
            if k.shape[0] != v.shape[0]:
                _fail(op, f"key T ({k.shape[0]}) must equal value T ({v.shape[0]})")
            dk, dv = k.shape[2], v.shape[2]
            s_kv = None
        elif layout == "BSH":
            if k.dim() != 3 or v.dim() != 3:
                _fail(op, f"key/value must be 3-D (B, S, H) for input_layout BSH, got {list(k.shape)}, {list(v.shape)}")
            if k.shape[2] % kvn or v.shape[2] % kvn:
                _fail(op, f"key/value H ({k.shape[2]}, {v.shape[2]}) must be a multiple of num_key_value_heads ({kvn})")
            kb, s_kv, dk, dv = k.shape[0], k.shape[1], k.shape[2] // kvn, v.shape[2] // kvn
            if v.shape[:2] != k.shape[:2] or kb != bsz:
                _fail(op, f"key {list(k.shape)} / value {list(v.shape)} batch and S must match each other and "
                          f"the query batch ({bsz})")
        else:
            if k.dim() != 4 or v.dim() != 4:
                _fail(op, f"key/value must be 4-D for input_layout {layout}, got {list(k.shape)}, {list(v.shape)}")
            if layout == "BSND":
                kb, s_kv, kn, dk = k.shape
                vb, vs, vn, dv = v.shape
            else:
                kb, kn, s_kv, dk = k.shape
                vb, vn, vs, dv = v.shape
            if kn != kvn or vn != kvn:
                _fail(op, f"key/value N dim ({kn}, {vn}) must equal num_key_value_heads ({kvn})")
            if (vb, vs) != (kb, s_kv) or kb != bsz:
                _fail(op, f"key {list(k.shape)} / value {list(v.shape)} batch and S must match each other and "
                          f"the query batch ({bsz})")
    if dk != d:
        _fail(op, f"key head dim ({dk}) must equal the query head dim ({d})")
    if dv <= 0 or dv > 512:
        _fail(op, f"value head dim ({dv}) must be in [1, 512]")

    # ---- lengths -------------------------------------------------------------------------------
    qlens = _as_lengths(op, nm["qlens"], a.qlens)
    kvlens = _as_lengths(op, nm["kvlens"], a.kvlens)
    jobs: list[_Job] = []
    if tnd:
        if qlens is None or kvlens is None:
            _fail(op, f"{nm['qlens']} and {nm['kvlens']} are both required for input_layout TND")
        bsz = len(qlens)
        if bsz == 0:
            _fail(op, f"{nm['qlens']} must not be empty for input_layout TND")
        if bsz > 4096:
            _fail(op, f"{nm['qlens']} has {bsz} batches; input_layout TND supports at most 4096")
        if len(kvlens) != bsz:
            _fail(op, f"{nm['qlens']} ({bsz} entries) and {nm['kvlens']} ({len(kvlens)} entries) must have the "
                      "same length (the batch size)")
        prev = 0
        for i, c in enumerate(qlens):
            if c < prev:
                _fail(op, f"{nm['qlens']} is cumulative and must be non-decreasing and >= 0; entry {i} is {c} "
                          f"after {prev}")
            prev = c
        if q.shape[0] != qlens[-1]:
            _fail(op, f"query T ({q.shape[0]}) must equal the last element of {nm['qlens']} ({qlens[-1]})")
        if paged:
            if any(x < 0 for x in kvlens):
                _fail(op, f"{nm['kvlens']} (per-sequence KV lengths with block_table) must be >= 0, got {kvlens}")
            kv_b = kvlens
        else:
            prev = 0
            for i, c in enumerate(kvlens):
                if c < prev:
                    _fail(op, f"{nm['kvlens']} is cumulative without block_table and must be non-decreasing and "
                              f">= 0; entry {i} is {c} after {prev}")
                prev = c
            if k.shape[0] != kvlens[-1]:
                _fail(op, f"key/value T ({k.shape[0]}) must equal the last element of {nm['kvlens']} "
                          f"({kvlens[-1]}) when block_table is not given")
            kv_b = [kvlens[0]] + [kvlens[i] - kvlens[i - 1] for i in range(1, bsz)]
        q_start = 0
        kv_start = 0
        for b in range(bsz):
            sq = qlens[b] - q_start
            skv = kv_b[b]
            src = ("pa", b) if paged else ("tnd", kv_start, kv_start + skv)
            jobs.append(_Job(b, sq, skv, (q_start, qlens[b]), src))
            q_start = qlens[b]
            if not paged:
                kv_start += skv
    else:
        def per_batch(lst: Optional[list[int]], name: str, full: Optional[int]) -> list[int]:
            if lst is None:
                if full is None:
                    _fail(op, f"{name} is required when block_table is given")
                return [full] * bsz
            if len(lst) == 1:
                lst = lst * bsz
            elif len(lst) >= bsz:
                lst = lst[:bsz]
            else:
                _fail(op, f"{name} has {len(lst)} entries; it needs 1 or >= B ({bsz})")
            for i, x in enumerate(lst):
                if x < 0 or (full is not None and x > full):
                    _fail(op, f"{name}[{i}] = {x} must be in [0, {full}]")
            return lst

        q_b = per_batch(qlens, nm["qlens"], s_q)
        kv_b = per_batch(kvlens, nm["kvlens"], None if paged else s_kv)
        for b in range(bsz):
            jobs.append(_Job(b, q_b[b], kv_b[b], (b, q_b[b]), ("pa", b) if paged else ("dense", b)))

    if paged:
        if bt.shape[0] != len(jobs):
            _fail(op, f"block_table first dim ({bt.shape[0]}) must equal the batch size ({len(jobs)})")
        need = [-(-j.skv // bs) for j in jobs]
        if need and max(need) > bt.shape[1]:
            _fail(op, f"block_table second dim ({bt.shape[1]}) is smaller than the blocks needed by "
                      f"{nm['kvlens']} (max {max(need)} blocks of {bs})")
        # Sequences may share physical blocks (prefix caching), so the documented "num_blocks >= blocks
        # needed" is checked per referenced block id: every id a sequence reads must exist in the cache.
        for job, nb in zip(jobs, need):
            if nb and int(bt[job.b, :nb].max()) >= num_blocks:
                _fail(op, f"block_table row {job.b} references block {int(bt[job.b, :nb].max())} but the KV cache "
                          f"has {num_blocks} blocks")

    # ---- masking -------------------------------------------------------------------------------
    mask = a.atten_mask
    if mask is not None:
        _check_tensor(op, "atten_mask", mask)
        if mask.dtype not in _MASK_DTYPES:
            _fail(op, f"atten_mask must be bool, int8 or uint8 (1 = masked), got {mask.dtype}")
    sliding = False
    mode = int(a.sparse_mode)
    if ifa:
        # decode kernel: sparse_mode ignored (no rope); pre_tokens is a window for BSH + paged 3-D cache
        if mask is not None:
            if mask.dim() < 2 or mask.shape[0] != bsz or any(s != 1 for s in mask.shape[1:-1]):
                _fail(op, f"atten_mask for Q_S = 1 must be (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B={bsz}, "
                          f"got {list(mask.shape)}")
            if any(j.skv > mask.shape[-1] for j in jobs):
                _fail(op, f"atten_mask KV dim ({mask.shape[-1]}) is smaller than {nm['kvlens']}")
        sliding = (layout == "BSH" and paged and k.dim() == 3 and int(a.pre_tokens) > 0)
    else:
        if mode not in (0, 1, 2, 3, 4):
            _fail(op, f"sparse_mode={mode} is not supported (0, 1, 2, 3 or 4)")
        if mode in (2, 3, 4):
            if mask is None:
                _fail(op, f"atten_mask is required for sparse_mode={mode}: the compressed (2048, 2048) causal template")
            if tuple(mask.shape) not in ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)):
                _fail(op, f"atten_mask for sparse_mode={mode} must have shape (2048, 2048), (1, 2048, 2048) or "
                          f"(1, 1, 2048, 2048), got {list(mask.shape)}")
            if not _is_causal_template(mask):
                _fail(op, f"atten_mask for sparse_mode={mode} must be the lower-triangular template "
                          "triu(ones(2048, 2048), diagonal=1) (1 = masked above the diagonal); the geometry comes from "
                          "sparse_mode/pre_tokens/next_tokens, a custom mask here is not honoured by the kernel")
            if mode == 4 and int(a.pre_tokens) + int(a.next_tokens) < 0:
                _fail(op, f"pre_tokens ({a.pre_tokens}) + next_tokens ({a.next_tokens}) must be >= 0 for sparse_mode=4")
            if mode == 4 and tnd:  # OTX-pfat CheckVarLenPreNextToken (batches with both lengths > 0)
                for j in jobs:
                    if j.sq and j.skv and (int(a.pre_tokens) + j.sq < 0 or int(a.next_tokens) + j.skv < 0):
                        _fail(op, f"batch {j.b}: {nm['qlens']} length ({j.sq}) + pre_tokens ({a.pre_tokens}) and "
                                  f"{nm['kvlens']} length ({j.skv}) + next_tokens ({a.next_tokens}) must be >= 0 "
                                  "for sparse_mode=4")
        elif mask is not None or mode == 1:
            if mask is None:
                _fail(op, "atten_mask (the full mask) is required for sparse_mode=1")
            if mask.dim() not in (2, 3, 4) or (mask.dim() == 4 and mask.shape[1] != 1):
                _fail(op, f"atten_mask for sparse_mode={mode} must be (Q_S, KV_S), (B|1, Q_S, KV_S) or "
                          f"(B|1, 1, Q_S, KV_S), got {list(mask.shape)}")
            if mask.dim() >= 3 and mask.shape[0] not in (1, len(jobs)):
                _fail(op, f"atten_mask batch dim ({mask.shape[0]}) must be 1 or B ({len(jobs)})")
            for j in jobs:
                if j.sq > mask.shape[-2] or j.skv > mask.shape[-1]:
                    _fail(op, f"atten_mask {list(mask.shape)} is smaller than batch {j.b}'s (Q_S, KV_S) = "
                              f"({j.sq}, {j.skv})")
            if paged and mask.shape[-1] < bt.shape[1] * bs:
                _fail(op, f"atten_mask KV dim ({mask.shape[-1]}) must be >= block_table.shape[1] * block_size "
                          f"({bt.shape[1] * bs}) with page attention")

    # ---- learnable sink (v2) -------------------------------------------------------------------
    sink = None
    if a.sink is not None:
        s = _check_tensor(op, "learnable_sink", a.sink)
        if layout != "TND":
            _fail(op, f"learnable_sink is supported only for input_layout TND/NTD_TND, got {layout}")
        if dv not in (64, 128):
            _fail(op, f"learnable_sink requires value head dim D in {{64, 128}}, got {dv}")
        if s.dim() != 1:
            _fail(op, f"learnable_sink must be 1-D, got {s.dim()}-D shape {list(s.shape)}")
        if s.shape[0] != n:
            _fail(op, f"learnable_sink length ({s.shape[0]}) must equal {nm['num_heads']} ({n})")
        ok = (torch.bfloat16, torch.float32) if ACCEPT_FLOAT32 else (torch.bfloat16,)
        if s.dtype not in ok:
            ext = " (or float32, a simulator extension)" if ACCEPT_FLOAT32 else ""
            _fail(op, f"learnable_sink must be bfloat16{ext}, got {s.dtype}")
        sink = None if "drop_sink" in _faults() else s.detach().to(torch.float32)  # FAULT_ENV: tests only

    if tnd:
        out_shape = (q.shape[0], n, dv)
        lse_shape = (q.shape[0], n, 1)
    elif layout == "BSH":
        out_shape = (bsz, s_q, n * dv)
        lse_shape = (bsz, n, s_q, 1)
    elif layout in ("BSND", "BNSD_BSND"):
        out_shape = (bsz, s_q, n, dv)
        lse_shape = (bsz, n, s_q, 1)
    else:
        out_shape = (bsz, n, s_q, dv)
        lse_shape = (bsz, n, s_q, 1)
    return _Plan(a, layout, n, kvn, d, dv, ifa, jobs, out_shape, lse_shape, paged, heads_major, sliding, sink, mask)


def _allowed(p: _Plan, j: _Job) -> Optional[torch.Tensor]:
    """The allowed set of one batch (docs/operators.md §3.3), or None for "every key"."""
    a, sq, skv, mask = p.a, j.sq, j.skv, p.mask
    if p.ifa:
        allowed = None
        if mask is not None:
            allowed = (mask[j.b].reshape(-1)[:skv] == 0).unsqueeze(0)
        if p.sliding and int(a.pre_tokens) < skv:
            win = _band(1, skv, skv - int(a.pre_tokens), skv)  # j >= Skv - pre_tokens
            allowed = win if allowed is None else allowed & win
        return allowed
    mode = int(a.sparse_mode)
    off = skv - sq
    pre, nxt = int(a.pre_tokens), int(a.next_tokens)
    if mode == 2:
        return _band(sq, skv, -(sq + skv + 1), 0)
    if mode == 3:
        return _band(sq, skv, -(sq + skv + 1), off)
    if mode == 4:
        extra = 1 if "band129" in _faults() else 0  # injected deviation (FAULT_ENV), tests only
        return _band(sq, skv, off - pre - extra, off + nxt)
    if mask is None:
        return None
    m = mask if mask.dim() == 2 else mask.reshape(mask.shape[0], mask.shape[-2], mask.shape[-1])[
        j.b if mask.shape[0] > 1 else 0]
    allowed = m[:sq, :skv] == 0
    if mode == 0:
        allowed = allowed & _band(sq, skv, -pre, nxt)
    return allowed


def _fia_compute(p: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    a = p.a
    q = a.query
    n, kvn, d, dv = p.n, p.kvn, p.d, p.dv
    scale = float(a.scale)
    if p.layout == "TND":
        q32 = q.to(torch.float32)
        out = torch.zeros((q.shape[0], n, dv), dtype=torch.float32)
        lse = torch.full((q.shape[0], n), _INF, dtype=torch.float32)
    else:
        if p.layout == "BSH":
            qv = q.reshape(q.shape[0], q.shape[1], n, d)
        elif p.layout == "BSND":
            qv = q
        else:
            qv = q.transpose(1, 2)
        q32 = qv.to(torch.float32)
        out = torch.zeros((qv.shape[0], qv.shape[1], n, dv), dtype=torch.float32)
        lse = torch.full((qv.shape[0], qv.shape[1], n), _INF, dtype=torch.float32)
    k, v = a.key, a.value
    if p.paged:
        bt = a.block_table
        bs = int(a.block_size)
    elif p.layout == "BSH":
        k = k.reshape(k.shape[0], k.shape[1], kvn, d)
        v = v.reshape(v.shape[0], v.shape[1], kvn, dv)
    elif p.layout in ("BNSD", "BNSD_BSND"):
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
    for j in p.jobs:
        if j.sq == 0:
            continue
        if p.layout == "TND":
            rows = slice(j.q_rows[0], j.q_rows[1])
            qb = q32[rows]
        else:
            qb = q32[j.b, : j.sq]
        if j.skv == 0:
            continue  # zero output row(s), LSE +inf (OPD-fia empty KV; OTX-ifa InitAllZeroOutput)
        src = j.kv_src
        if src[0] == "pa":
            kb = _gather_paged(a.op, k, bt[j.b], j.skv, bs, kvn, p.heads_major, j.b)
            vb = _gather_paged(a.op, v, bt[j.b], j.skv, bs, kvn, p.heads_major, j.b)
        elif src[0] == "tnd":
            kb = k[src[1]:src[2]].to(torch.float32)
            vb = v[src[1]:src[2]].to(torch.float32)
        else:
            kb = k[j.b, : j.skv].to(torch.float32)
            vb = v[j.b, : j.skv].to(torch.float32)
        ob, lb = _attend(qb, kb, vb, scale, allowed=_allowed(p, j), sink=p.sink)
        if p.layout == "TND":
            out[rows] = ob
            lse[rows] = lb
        else:
            out[j.b, : j.sq] = ob
            lse[j.b, : j.sq] = lb
    out = out.to(q.dtype)
    if p.layout == "TND":
        lse_t = lse.unsqueeze(-1)
    else:
        lse_t = lse.permute(0, 2, 1).unsqueeze(-1).contiguous()
        if p.layout == "BSH":
            out = out.reshape(out.shape[0], out.shape[1], n * dv)
        elif p.layout == "BNSD":
            out = out.transpose(1, 2).contiguous()
    return out, lse_t


def _fia_functional(a: _Fia) -> tuple[torch.Tensor, torch.Tensor]:
    plan = _fia_prepare(a)
    out, lse = _fia_compute(plan)
    if not a.want_lse:
        lse = torch.zeros(1, dtype=torch.float32)
    return out, lse


def _split_out(op: str, out: Any, attention_out: Any, softmax_lse: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if out is not None:
        if attention_out is not None or softmax_lse is not None:
            _fail(op + ".out", "pass either out=[attention_out, softmax_lse] or attention_out=/softmax_lse=, not both")
        if not isinstance(out, (list, tuple)) or len(out) != 2:
            _fail(op + ".out", "out must be a list [attention_out, softmax_lse]")
        attention_out, softmax_lse = out
    if not isinstance(attention_out, torch.Tensor) or not isinstance(softmax_lse, torch.Tensor):
        _fail(op + ".out", "out=[attention_out, softmax_lse] (two tensors) is required")
    return attention_out, softmax_lse


def _fia_out(a: _Fia, workspace: Any, out: Any, attention_out: Any, softmax_lse: Any):
    op = a.op + ".out"
    o_t, l_t = _split_out(a.op, out, attention_out, softmax_lse)
    if workspace is not None and not isinstance(workspace, torch.Tensor):
        _fail(op, f"workspace must be a tensor or None, got {type(workspace).__name__}")
    plan = _fia_prepare(a)
    if tuple(o_t.shape) != tuple(plan.out_shape) or o_t.dtype != a.query.dtype:
        _fail(op, f"attention_out must have shape {list(plan.out_shape)} and dtype {a.query.dtype}, got "
                  f"{list(o_t.shape)} {o_t.dtype}")
    if a.want_lse and (tuple(l_t.shape) != tuple(plan.lse_shape) or l_t.dtype != torch.float32):
        _fail(op, f"softmax_lse must have shape {list(plan.lse_shape)} and dtype float32 when "
                  f"{a.names['want_lse']}=True, got {list(l_t.shape)} {l_t.dtype}")
    res, lse = _fia_compute(plan)
    o_t.copy_(res)
    if a.want_lse:
        l_t.copy_(lse)
    return o_t, l_t


def _workspace(a: _Fia) -> torch.Tensor:
    _fia_prepare(a)
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)


def npu_fused_infer_attention_score(query, key, value, **kwargs):
    """``torch_npu.npu_fused_infer_attention_score`` (v1): fused attention over dense or paged K/V.

    Signature (OPY72; keyword-only after ``value``)::

        (query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
         actual_seq_lengths_kv=None, <quant/antiquant args>=None, block_table=None, query_padding_size=None,
         kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
         query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
         pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0,
         sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0,
         value_antiquant_mode=0, softmax_lse_flag=False) -> (attention_out, softmax_lse)

    Shapes (docs/operators.md §3.7; ``N = num_heads``, ``KV_N = num_key_value_heads or N``):

    * ``TND``: query ``(T, N, D)``; key/value ``(T_kv, KV_N, D|Dv)`` or a paged cache; out ``(T, N, Dv)``.
      ``actual_seq_lengths`` is cumulative (``T`` must equal its last element); ``actual_seq_lengths_kv``
      is cumulative without ``block_table`` (``T_kv`` = its last element) and per-sequence with it (docs/operators.md §3.7).
    * ``BSH`` ``(B, S, N*D)``, ``BSND`` ``(B, S, N, D)``, ``BNSD`` ``(B, N, S, D)``, ``BNSD_BSND``
      (BNSD in, BSND out, Q_S > 1): lengths per batch (one entry broadcasts, longer lists are truncated).
    * Paged KV (``block_table`` int32 ``(B, >= max_blocks)``, ``block_size``): cache
      ``(num_blocks, block_size, KV_N*D)`` for every layout, or ``(num_blocks, KV_N, block_size, D)`` for
      BNSD/TND; logical position ``p`` of batch ``b`` is ``cache[block_table[b, p // block_size], p % block_size]``
      (docs/operators.md §3.7). ``input_layout`` of key/value is then ignored.
    * ``softmax_lse``: float32 ``(T, N, 1)`` for TND or ``(B, N, S, 1)`` when ``softmax_lse_flag``; else a
      float32 ``(1,)`` zero tensor (OPD-fia return values).

    Semantics: TND, or Q_S > 1, runs the prefill kernel with the ``sparse_mode`` geometry of docs/operators.md §3.3 (0: all keys,
    or mask + top-left ``i-pre <= j <= i+next``; 1: full mask; 2: ``j <= i``; 3: ``j <= i + Skv - Sq``;
    4: ``i + off - pre <= j <= i + off + next`` with ``off = Skv - Sq``, so ``pre_tokens=128`` admits 129
    keys); Q_S = 1 in BSH/BSND/BNSD runs the decode kernel, which ignores ``sparse_mode`` and, for BSH + paged
    3-D cache + ``pre_tokens > 0``, keeps only the last ``pre_tokens`` keys (OTX-ifa ``slidingFlag_``,
    ``startPosition = curActualSeqLen - windowSize``). GQA: head ``n`` uses KV head ``n // (N/KV_N)`` (docs/operators.md §3.1).
    Computed in float32, returned in the query dtype; KV length 0 or no allowed key -> zero row (docs/operators.md §3.3, §3.7).

    Dtypes: query/key/value float16 or bfloat16, all equal (float32 accepted as a simulator extension, see
    :data:`ACCEPT_FLOAT32`); ``atten_mask`` bool/int8/uint8 (1 = masked).

    Raises:
        RuntimeError: a documented limit is violated - the message names the argument (OPD-fia, OPD-fia2
            constraints: dtypes, non-contiguous ``atten_mask`` (query/key/value: :data:`ACCEPT_STRIDED_QKV`),
            ``num_heads`` not a multiple of
            ``num_key_value_heads`` or ratio > 64, N > 256, D not a multiple of 16 or > 512, TND with > 4096
            batches / missing or decreasing lengths / ``T`` != last cumulative length, ``sparse_mode`` not in
            0-4, mask shape for modes 2-4 not (1,)(1,)2048x2048 or not the causal template, band
            ``pre_tokens + next_tokens < 0`` or (TND) a batch with ``Sq + pre_tokens < 0`` or
            ``Skv + next_tokens < 0`` (OTX-pfat ``CheckVarLenPreNextToken``), block_size rules (TND: multiple of 16, <= 1024; Q_S > 1 in
            BSH/BSND/BNSD: multiple of 128 in [128, 512]; Q_S = 1: <= 512), block_table shape/dtype, too few
            blocks, out-of-range block ids).
        NotEmulatedError: quantisation, pse, rope, shared-prefix or padding-size arguments, NTD-style layouts.

    Sources: OPD-fia (parameters, constraints, return values); OPY72 (schema); docs/operators.md §3.7, §3; OTX-fiat
    ``IsUsingIFA``; OTX-pfa ``GetS2LoopRange`` BAND offsets; OTX-ifa sliding window.
    """
    return _fia_functional(_v1_args(query, key, value, **kwargs))


def _v1_out(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
    """``torch_npu.npu_fused_infer_attention_score.out``: the v1 operator writing into caller buffers.

    Called as ``op.out(<functional arguments>, workspace=None, out=[attention_out, softmax_lse])`` (PT-blk;
    VA@v0.15.0rc1 ``full_graph_fia``). ``attention_out`` must have the functional output's shape and the
    query dtype and is overwritten; ``softmax_lse`` is written only when ``softmax_lse_flag=True`` (then it must
    be float32 of the LSE shape), otherwise it is left untouched (vllm-ascend passes ``torch.empty(1)`` of the
    query dtype). ``workspace`` (from ``_npu_fused_infer_attention_score_get_max_workspace``) is accepted and
    unused on the CPU. Returns ``(attention_out, softmax_lse)`` - the same tensor objects.

    Raises:
        RuntimeError: as the functional form, or a wrong ``out`` buffer shape/dtype.
        NotEmulatedError: as the functional form.

    Sources: OPY72 ``npu_fused_infer_attention_score.out`` schema; docs/operators.md §3.7.
    """
    return _fia_out(_v1_args(query, key, value, **kwargs), workspace, out, attention_out, softmax_lse)


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    """``torch_npu._npu_fused_infer_attention_score_get_max_workspace``: workspace for the ``.out`` form.

    Takes the functional arguments, validates them exactly as the operator does (so errors surface at graph
    capture, where vllm-ascend calls it) and returns a uint8 tensor of :data:`WORKSPACE_BYTES` zeros. The size
    is **not meaningful on the CPU** (no workspace is used); on the NPU it is the tiling's maximum workspace.

    Raises:
        RuntimeError / NotEmulatedError: as :func:`npu_fused_infer_attention_score`.

    Sources: OPY72 schema; docs/operators.md §3.7, §6 (graph capture).
    """
    return _workspace(_v1_args(query, key, value, **kwargs))


def npu_fused_infer_attention_score_v2(query, key, value, **kwargs):
    """``torch_npu.npu_fused_infer_attention_score_v2``: v1 with renamed arguments plus ``learnable_sink``.

    Signature (OPY72; keyword-only after ``value``)::

        (query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
         actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, <dequant/quant args>=None,
         learnable_sink=None, num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
         pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0,
         query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False,
         <*_dtype reserved>=None, quant_scale_p=None, out_dtype=None) -> (attention_out, softmax_lse)

    Renames (docs/operators.md §3.7): ``num_heads -> num_query_heads``, ``scale -> softmax_scale``,
    ``actual_seq_lengths -> actual_seq_qlen``, ``actual_seq_lengths_kv -> actual_seq_kvlen``,
    ``softmax_lse_flag -> return_softmax_lse``. Shapes, layouts, lengths and masking are those of
    :func:`npu_fused_infer_attention_score`.

    ``learnable_sink`` (docs/operators.md §3.5): bfloat16 ``(Q_N,)`` (float32 accepted as a simulator extension),
    one unscaled logit per query head added to the softmax denominator only:
    ``out_i = sum_j e^{s_ij - m} v_j / (sum_j e^{s_ij - m} + e^{sink_n - m})``, ``m`` = max of the real scores.
    Only input_layout TND (NTD_TND is not emulated) with value D in {64, 128}. The returned ``softmax_lse``
    excludes the sink term (see the module docstring; OTX-pfa order of LSE write vs ``Bmm2ResultDiv``).

    Raises:
        RuntimeError: as v1, plus sink constraints - layout not TND, value D not 64/128, sink not 1-D, length
            != ``num_query_heads``, dtype not bfloat16 (OTX-fiat ``CheckOutShape``; OTX-pfat
            ``CheckLearnableSinkWhenLayoutIsTND``; OTX ``fused_infer_attention_score_def.cpp``
            ``learnable_sink`` DataTypeList {DT_BF16}).
        NotEmulatedError: rope, pse, (de)quantisation, reserved ``*_dtype``/``out_dtype``/``quant_scale_p``.

    Sources: OPD-fia2 ``learnable_sink``; OPT-test_npu_fused_infer_attention_score_v2.py ``npSoftmax_new``;
    OTX-pfa ``Bmm2ResultDiv``; GPTOSS ``sdpa``.
    """
    return _fia_functional(_v2_args(query, key, value, **kwargs))


def _v2_out(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
    """``torch_npu.npu_fused_infer_attention_score_v2.out``: v2 writing into ``out=[attention_out, softmax_lse]``.

    Same contract as ``npu_fused_infer_attention_score.out`` (``softmax_lse`` written only when
    ``return_softmax_lse=True``, else untouched; ``workspace`` unused), with the v2 arguments. Returns the two
    ``out`` tensors.

    Raises:
        RuntimeError / NotEmulatedError: as :func:`npu_fused_infer_attention_score_v2`, or a wrong ``out`` buffer.

    Sources: OPY72 ``npu_fused_infer_attention_score_v2.out`` schema; VA@main ``update_graph_params`` sink branch.
    """
    return _fia_out(_v2_args(query, key, value, **kwargs), workspace, out, attention_out, softmax_lse)


def _npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs):
    """``torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace``: workspace for the v2 ``.out`` form.

    Validates the v2 arguments like the operator and returns a uint8 tensor of :data:`WORKSPACE_BYTES` zeros;
    the size is not meaningful on the CPU.

    Raises:
        RuntimeError / NotEmulatedError: as :func:`npu_fused_infer_attention_score_v2`.

    Sources: OPY72 schema; docs/operators.md §3.7.
    """
    return _workspace(_v2_args(query, key, value, **kwargs))


def _adopt_signature(fn: Callable, spec: Callable, extra: tuple[str, ...] = ()) -> None:
    """Give ``fn`` the full keyword signature of ``spec`` (plus keyword-only ``extra`` names) for introspection."""
    sig = inspect.signature(spec)
    params = list(sig.parameters.values())
    for name in extra:
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None))
    fn.__signature__ = sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


_adopt_signature(npu_fused_infer_attention_score, _v1_args)
_adopt_signature(_npu_fused_infer_attention_score_get_max_workspace, _v1_args)
_adopt_signature(_v1_out, _v1_args, ("workspace", "out"))
_adopt_signature(npu_fused_infer_attention_score_v2, _v2_args)
_adopt_signature(_npu_fused_infer_attention_score_v2_get_max_workspace, _v2_args)
_adopt_signature(_v2_out, _v2_args, ("workspace", "out"))

with_out(npu_fused_infer_attention_score, _v1_out, "npu_fused_infer_attention_score")
with_out(npu_fused_infer_attention_score_v2, _v2_out, "npu_fused_infer_attention_score_v2")
_v1_out.__qualname__ = "npu_fused_infer_attention_score.out"
_v2_out.__qualname__ = "npu_fused_infer_attention_score_v2.out"


# --------------------------------------------------------------------------------------------------
# ATB operators
# --------------------------------------------------------------------------------------------------

def _atb_heads(op: str, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    n, kvn = int(num_heads), int(num_kv_heads)
    if n <= 0:
        _fail(op, f"num_heads must be > 0, got {num_heads}")
    if kvn <= 0:
        _fail(op, f"num_kv_heads must be > 0, got {num_kv_heads}")
    if n % kvn:
        _fail(op, f"num_heads ({n}) must be a multiple of num_kv_heads ({kvn})")
    return n, kvn


def _atb_tokens(op: str, name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    """ATB packed tensors: ``(T, heads, D)`` or ``(T, heads*D)`` -> a ``(T, heads, D)`` view."""
    if t.dim() == 3:
        if t.shape[1] != heads:
            _fail(op, f"{name} head dim ({t.shape[1]}) must equal {heads}")
        return t
    if t.dim() == 2:
        if t.shape[1] % heads:
            _fail(op, f"{name} hidden size ({t.shape[1]}) must be a multiple of {heads}")
        return t.reshape(t.shape[0], heads, t.shape[1] // heads)
    _fail(op, f"{name} must be (T, heads, D) or (T, heads*D), got shape {list(t.shape)}")
    return t  # unreachable


def _atb_same_dtype(op: str, **tensors: torch.Tensor) -> torch.dtype:
    items = list(tensors.items())
    _check_float_dtype(op, items[0][0], items[0][1])
    for name, t in items[1:]:
        if t.dtype != items[0][1].dtype:
            _fail(op, f"{name} dtype {t.dtype} must equal {items[0][0]} dtype {items[0][1].dtype}")
    return items[0][1].dtype


def _atb_paged_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, kvn: int) -> tuple[int, int]:
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        _fail(op, f"key_cache/value_cache must be 4-D (num_blocks, block_size, num_kv_heads, D), got "
                  f"{list(key_cache.shape)}, {list(value_cache.shape)}")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        _fail(op, f"key_cache {list(key_cache.shape)} and value_cache {list(value_cache.shape)} must agree on "
                  "(num_blocks, block_size, num_kv_heads)")
    if key_cache.shape[2] != kvn:
        _fail(op, f"key_cache head dim ({key_cache.shape[2]}) must equal num_kv_heads ({kvn})")
    return key_cache.shape[0], key_cache.shape[1]


def _atb_block_table(op: str, block_table: Any, bsz: int, lens: list[int], block_size: int) -> torch.Tensor:
    bt = _check_tensor(op, "block_table", block_table)
    if bt.dim() != 2 or bt.dtype != torch.int32:
        _fail(op, f"block_table must be a 2-D int32 tensor, got {list(bt.shape)} {bt.dtype}")
    if bt.shape[0] < bsz:
        _fail(op, f"block_table has {bt.shape[0]} rows for {bsz} sequences")
    need = max((-(-x // block_size) for x in lens), default=0)
    if need > bt.shape[1]:
        _fail(op, f"block_table has {bt.shape[1]} columns but a sequence needs {need} blocks of {block_size}")
    return bt


def _atb_mask(op: str, mask: torch.Tensor, qdtype: torch.dtype, bsz: int,
              lens_q: list[int], lens_kv: list[int]) -> Callable[[int, int, int], tuple]:
    """ATB NORM mask (docs/operators.md §3.7) -> per-batch ``(allowed, bias)``.

    fp16 masks are additive (``-inf``/``-10000`` = masked); every other dtype is boolean (nonzero = masked): bf16,
    int8, uint8 and bool as ATB documents (HIA-mask), and float32 - a simulator extension (the operator documents
    fp16/bf16 queries) - by the convention of the only caller that builds one: VA@v0.11.0
    ``attention_mask.py`` ``_generate_attn_mask`` writes ``-inf`` for fp16 and ``1`` for every other dtype. (Reading
    float32 as additive gave a served float32 Llama no causal mask and a +1 bonus on future keys: issue 32.)
    Shapes ``(max_s, max_s)``, ``(1|B, max_s, max_s)`` or ``(B, 1, max_s)``; batch ``b`` uses
    ``mask[..., :q_s, :kv_s]`` (top-left).
    """
    mask = _check_tensor(op, "mask", mask)
    if mask.dtype not in (torch.float16, torch.bfloat16, torch.float32) + _MASK_DTYPES:
        _fail(op, f"mask dtype {mask.dtype} is not supported (float16/bfloat16/int8/bool)")
    additive = mask.dtype == torch.float16
    if mask.dim() == 2:
        get = lambda b: mask  # noqa: E731
    elif mask.dim() == 3 and (mask.shape[0] in (1, bsz)):
        get = lambda b: mask[b if mask.shape[0] > 1 else 0]  # noqa: E731
    elif mask.dim() == 4 and mask.shape[0] in (1, bsz) and mask.shape[1] == 1:
        get = lambda b: mask[b if mask.shape[0] > 1 else 0, 0]  # noqa: E731
    else:
        _fail(op, f"mask must be (max_s, max_s), (B, max_s, max_s) or (B, 1, max_s), got {list(mask.shape)}")
    for b in range(bsz):
        mb = get(b)
        rows_ok = mb.shape[0] == 1 or mb.shape[0] >= lens_q[b]
        if not rows_ok or mb.shape[1] < lens_kv[b]:
            _fail(op, f"mask {list(mask.shape)} is smaller than sequence {b} ({lens_q[b]} x {lens_kv[b]})")

    def per_batch(b: int, sq: int, skv: int) -> tuple:
        mb = get(b)
        mb = mb[:sq, :skv] if mb.shape[0] != 1 else mb[:, :skv].expand(sq, skv)
        if additive:
            return None, mb.to(torch.float32)
        return mb == 0, None

    return per_batch


def _lens(op: str, name: str, x: Any) -> list[int]:
    vals = _as_lengths(op, name, x)
    if vals is None:
        _fail(op, f"{name} is required")
    if any(v < 0 for v in vals):
        _fail(op, f"{name} must be >= 0, got {vals}")
    return vals


def _npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    """``torch_npu._npu_flash_attention``: ATB SelfAttention prefill over packed sequences, no KV cache.

    Args:
        query: ``(T, N, D)`` (or ``(T, N*D)``) float16/bfloat16.
        key: ``(T, KV_N, D)`` (or 2-D), same dtype.
        value: ``(T, KV_N, Dv)`` (or 2-D), same dtype.
        mask: ``(max_s, max_s)``, ``(1|B, max_s, max_s)`` or ``(B, 1, max_s)``; fp16 (and float32) masks are
            **added** to the scaled scores (``-inf`` masked), bf16/int8/bool masks are boolean (nonzero =
            masked) - ATB NORM mask (HIA-mask; VA@v0.11.0 ``_generate_attn_mask``). Batch ``b`` uses
            ``mask[:q_s, :kv_s]``; there is no implicit causal mask.
        seq_len: per-sequence lengths (query and KV lengths equal), int tensor (host) or list.
        scale_value: multiplier of ``q.k``.
        num_heads, num_kv_heads: N and KV_N (GQA head ``n`` -> KV head ``n // (N/KV_N)``).
        out: ``(T, N, Dv)`` (or the 2-D form), query dtype; rows of the sequences are overwritten, rows
            beyond ``sum(seq_len)`` are left untouched.

    Returns ``None`` (ATB ops write into ``out``).

    Raises:
        RuntimeError: dtype (fp16/bf16; float32 only as the simulator extension) or shape mismatches,
            ``num_heads`` not a multiple of ``num_kv_heads``, ``sum(seq_len)`` > T, mask too small.

    Sources: OPC-atb ``SelfAttentionAtb.cpp`` (``PA_ENCODER``, ``MASK_TYPE_NORM``, BSND);
    OPT-test_atb_flash_attention.py golden (``score + mask[:, :q_s, :kv_s]``); docs/operators.md §3.7.
    """
    op = "_npu_flash_attention"
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        _check_tensor(op, name, t)
    n, kvn = _atb_heads(op, num_heads, num_kv_heads)
    dt = _atb_same_dtype(op, query=query, key=key, value=value, out=out)
    q3 = _atb_tokens(op, "query", query, n)
    k3 = _atb_tokens(op, "key", key, kvn)
    v3 = _atb_tokens(op, "value", value, kvn)
    o3 = _atb_tokens(op, "out", out, n)
    if k3.shape[2] != q3.shape[2]:
        _fail(op, f"key head dim ({k3.shape[2]}) must equal the query head dim ({q3.shape[2]})")
    if not (q3.shape[0] == k3.shape[0] == v3.shape[0] == o3.shape[0]):
        _fail(op, f"query/key/value/out token counts differ: {q3.shape[0]}, {k3.shape[0]}, {v3.shape[0]}, "
                  f"{o3.shape[0]}")
    if o3.shape[2] != v3.shape[2]:
        _fail(op, f"out head dim ({o3.shape[2]}) must equal the value head dim ({v3.shape[2]})")
    lens = _lens(op, "seq_len", seq_len)
    if sum(lens) > q3.shape[0]:
        _fail(op, f"sum(seq_len) = {sum(lens)} exceeds the {q3.shape[0]} query tokens")
    if mask is None:
        _fail(op, "mask is required (ATB SelfAttention MASK_TYPE_NORM)")
    mask_fn = _atb_mask(op, mask, dt, len(lens), lens, lens)
    q32 = q3.to(torch.float32)
    k32 = k3.to(torch.float32)
    v32 = v3.to(torch.float32)
    start = 0
    for b, s in enumerate(lens):
        if s:
            allowed, bias = mask_fn(b, s, s)
            ob, _ = _attend(q32[start:start + s], k32[start:start + s], v32[start:start + s], float(scale_value),
                            allowed=allowed, bias=bias)
            o3[start:start + s] = ob.to(dt)
        start += s


def _npu_flash_attention_qlens(query, key_cache, value_cache, block_table, mask, seq_len, context_lens,
                               num_kv_heads, num_heads, scale_value, out):
    """``torch_npu._npu_flash_attention_qlens``: ATB prefill of new query tokens over a paged KV prefix.

    Args:
        query: ``(Tq, N, D)`` float16/bfloat16 (packed new tokens of all sequences).
        key_cache: ``(num_blocks, block_size, KV_N, D)``; value_cache ``(num_blocks, block_size, KV_N, Dv)``;
            block_size must be 128.
        block_table: int32 ``(B, max_blocks)``.
        mask: compressed causal template (2-D square, nonzero exactly above the diagonal: bf16 1 / fp16
            ``-inf``); geometry comes from the lengths, not from the mask content.
        seq_len: per-sequence **query** lengths; context_lens: per-sequence **total** KV lengths (int tensors
            or lists).
        num_kv_heads, num_heads, scale_value: as the name says.
        out: ``(Tq, N, Dv)`` query dtype; rows beyond ``sum(seq_len)`` are left untouched.

    Semantics: right-down causal, query row ``i`` of sequence ``b`` attends KV positions
    ``j <= i + context_lens[b] - seq_len[b]``, K/V read through the block table (docs/operators.md §3.7).
    Returns ``None``.

    Raises:
        RuntimeError: shape/dtype mismatches, block_size != 128 ("blockSize=128"), mask not a square causal
            template, too few block-table columns, out-of-range block ids.

    Sources: OPC-atb ``SelfAttentionQlensAtb.cpp`` (``PREFIX_ENCODER``, ``MASK_TYPE_NORM_COMPRESS``,
    ``isTriuMask=1``); OPT-test_atb_flash_attention_qlens.py (golden ``mask[:, kv-q:kv, :kv]``, block_size
    other than 128 raises ``RuntimeError`` matching "blockSize=128").
    """
    op = "_npu_flash_attention_qlens"
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        _check_tensor(op, name, t)
    n, kvn = _atb_heads(op, num_heads, num_kv_heads)
    dt = _atb_same_dtype(op, query=query, key_cache=key_cache, value_cache=value_cache, out=out)
    q3 = _atb_tokens(op, "query", query, n)
    o3 = _atb_tokens(op, "out", out, n)
    num_blocks, block_size = _atb_paged_cache(op, key_cache, value_cache, kvn)
    if block_size != 128:
        _fail(op, f"only blockSize=128 is supported, got key_cache block_size {block_size}")
    if key_cache.shape[3] != q3.shape[2]:
        _fail(op, f"key_cache head dim ({key_cache.shape[3]}) must equal the query head dim ({q3.shape[2]})")
    if o3.shape[0] != q3.shape[0] or o3.shape[2] != value_cache.shape[3]:
        _fail(op, f"out must be ({q3.shape[0]}, {n}, {value_cache.shape[3]}), got {list(out.shape)}")
    qlens = _lens(op, "seq_len", seq_len)
    kvlens = _lens(op, "context_lens", context_lens)
    if len(qlens) != len(kvlens):
        _fail(op, f"seq_len ({len(qlens)}) and context_lens ({len(kvlens)}) must have one entry per sequence")
    if sum(qlens) > q3.shape[0]:
        _fail(op, f"sum(seq_len) = {sum(qlens)} exceeds the {q3.shape[0]} query tokens")
    mask = _check_tensor(op, "mask", mask)
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        _fail(op, f"mask must be the 2-D square compressed causal template, got {list(mask.shape)}")
    if not _is_causal_template(mask):
        _fail(op, "mask must be the compressed causal template triu(ones, diagonal=1) (nonzero above the diagonal)")
    bt = _atb_block_table(op, block_table, len(qlens), kvlens, block_size)
    q32 = q3.to(torch.float32)
    start = 0
    for b, (sq, skv) in enumerate(zip(qlens, kvlens)):
        if sq and skv == 0:
            o3[start:start + sq] = 0
        elif sq:
            kb = _gather_paged(op, key_cache, bt[b], skv, block_size, kvn, False, b)
            vb = _gather_paged(op, value_cache, bt[b], skv, block_size, kvn, False, b)
            allowed = _band(sq, skv, -(sq + skv + 1), skv - sq)
            ob, _ = _attend(q32[start:start + sq], kb, vb, float(scale_value), allowed=allowed)
            o3[start:start + sq] = ob.to(dt)
        start += sq


def _paged_decode_checks(op, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, context_lens,
                         out):
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        _check_tensor(op, name, t)
    n, kvn = _atb_heads(op, num_heads, num_kv_heads)
    dt = _atb_same_dtype(op, query=query, key_cache=key_cache, value_cache=value_cache, out=out)
    q3 = _atb_tokens(op, "query", query, n)
    o3 = _atb_tokens(op, "out", out, n)
    num_blocks, block_size = _atb_paged_cache(op, key_cache, value_cache, kvn)
    if key_cache.shape[3] != q3.shape[2]:
        _fail(op, f"key_cache head dim ({key_cache.shape[3]}) must equal the query head dim ({q3.shape[2]})")
    if o3.shape[0] != q3.shape[0] or o3.shape[2] != value_cache.shape[3]:
        _fail(op, f"out must be ({q3.shape[0]}, {n}, {value_cache.shape[3]}), got {list(out.shape)}")
    lens = _lens(op, "context_lens", context_lens)
    # the batch is len(context_lens); query rows past it are a graph-padded batch's padding (see _npu_paged_attention)
    if len(lens) > q3.shape[0]:
        _fail(op, f"context_lens has {len(lens)} entries for {q3.shape[0]} query tokens (one per sequence)")
    bt = _atb_block_table(op, block_table, len(lens), lens, block_size)
    return n, kvn, dt, q3, o3, block_size, lens, bt


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, *, workspace=None):
    """``torch_npu._npu_paged_attention``: ATB PagedAttention decode, one query token per sequence, no mask.

    Args:
        query: ``(B, N, D)`` float16/bfloat16.
        key_cache: ``(num_blocks, block_size, KV_N, D)``; value_cache ``(num_blocks, block_size, KV_N, Dv)``.
        num_kv_heads, num_heads, scale_value: KV_N, N, multiplier of ``q.k``.
        block_table: int32 ``(B, max_blocks)``; context_lens: ``(B,)`` int (host tensor or list).
        out: ``(B, N, Dv)`` query dtype, overwritten.
        workspace: optional tensor from :func:`_npu_paged_attention_get_workspace` (unused on the CPU).

    Semantics: sequence ``b`` attends all ``context_lens[b]`` cached positions (no sinks, no window);
    ``context_lens[b] = 0`` gives a zero row. The batch is ``len(context_lens)``: query rows past it are left
    untouched in ``out`` (calibration: vllm-ascend 0.12.0rc1 ``AscendAttentionBackendImpl._forward_decode_only``
    passes the query of a PIECEWISE batch padded to its graph size with the unpadded ``seq_lens``, for every model,
    and runs on hardware; UNVERIFIED what the device writes into the padding rows, which vLLM discards). Returns
    ``None``.

    Raises:
        RuntimeError: shape/dtype mismatches, ``num_heads`` not a multiple of ``num_kv_heads``, too few
            block-table columns, out-of-range block ids.

    Sources: OPC-atb ``PagedAttentionAtb.cpp`` (``maskType=UNDEFINED``); OPT-test_atb_paged_attention.py
    ``ref_attention_impl``; docs/operators.md §3.7.
    """
    op = "_npu_paged_attention"
    if workspace is not None and not isinstance(workspace, torch.Tensor):
        _fail(op, f"workspace must be a tensor or None, got {type(workspace).__name__}")
    n, kvn, dt, q3, o3, bs, lens, bt = _paged_decode_checks(op, query, key_cache, value_cache, num_kv_heads,
                                                           num_heads, block_table, context_lens, out)
    q32 = q3.to(torch.float32)
    for b, skv in enumerate(lens):
        if skv == 0:
            o3[b] = 0
            continue
        kb = _gather_paged(op, key_cache, bt[b], skv, bs, kvn, False, b)
        vb = _gather_paged(op, value_cache, bt[b], skv, bs, kvn, False, b)
        ob, _ = _attend(q32[b:b + 1], kb, vb, float(scale_value))
        o3[b] = ob[0].to(dt)


def _npu_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                       block_table, context_lens, out):
    """``torch_npu._npu_paged_attention_get_workspace``: the workspace of ``_npu_paged_attention``.

    Same arguments as :func:`_npu_paged_attention` without ``workspace`` (``out`` included, as in the schema);
    validates them and returns a uint8 tensor of :data:`WORKSPACE_BYTES` zeros. The size is not meaningful on
    the CPU (on the NPU it is ATB's ``GetAtbWorkspaceSizeCmd``).

    Raises:
        RuntimeError: as :func:`_npu_paged_attention`.

    Sources: OPC-atb ``PagedAttentionAtb.cpp`` ``_npu_paged_attention_get_workspace``; docs/operators.md §3.7.
    """
    _paged_decode_checks("_npu_paged_attention_get_workspace", query, key_cache, value_cache, num_kv_heads,
                         num_heads, block_table, context_lens, out)
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8)


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """``torch_npu._npu_reshape_and_cache``: scatter new K/V tokens into the paged cache, in place.

    Args:
        key: ``(T, KV_N, D)``; value ``(T, KV_N, Dv)``.
        key_cache: ``(num_blocks, block_size, KV_N, D)``; value_cache ``(num_blocks, block_size, KV_N, Dv)``;
            contiguous, same dtype as key/value (fp16/bf16; float32 as the simulator extension).
        slot_indices: int32 ``(T,)``; token ``t`` goes to ``cache[slot // block_size, slot % block_size]``;
            negative slots (vLLM's padding ``-1``) are skipped.

    Returns ``None``.

    Raises:
        RuntimeError: dtype/shape mismatches, non-contiguous caches, slot_indices not int32 of length T, a slot
            >= num_blocks * block_size.

    A slot named more than once breaks the operator's precondition (ATB ReshapeAndCache: slot values lie in
    ``(-num_blocks*block_size, num_blocks*block_size)`` and are not repeated) but is not checked by the kernel, which
    writes the tokens in parallel: the slot's content is then undefined. vLLM's warm-up and graph-capture dummy runs do
    exactly that (a zero-filled ``slot_mapping``). The simulator writes NaN into such a slot, so the call succeeds as
    on the device and any later read of the slot poisons what is computed from it instead of passing silently.

    Sources: OPC-atb ``ReshapeAndCachAtb.cpp``; OPT-test_atb_reshape_and_cache.py ``cal_nd``; ATB
    ReshapeAndCacheOperation doc (hiascend canncommercial 80RC3 ascendtb_01_0089); docs/operators.md §3.7.
    """
    op = "_npu_reshape_and_cache"
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_indices", slot_indices)):
        _check_tensor(op, name, t)
    _atb_same_dtype(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if key.dim() != 3 or value.dim() != 3:
        _fail(op, f"key/value must be (T, KV_N, D), got {list(key.shape)}, {list(value.shape)}")
    if key.shape[:2] != value.shape[:2]:
        _fail(op, f"key {list(key.shape)} and value {list(value.shape)} must agree on (T, KV_N)")
    kvn = key.shape[1]
    num_blocks, block_size = _atb_paged_cache(op, key_cache, value_cache, kvn)
    if key_cache.shape[3] != key.shape[2] or value_cache.shape[3] != value.shape[2]:
        _fail(op, f"cache head dims ({key_cache.shape[3]}, {value_cache.shape[3]}) must equal key/value head dims "
                  f"({key.shape[2]}, {value.shape[2]})")
    _check_contiguous(op, "key_cache", key_cache)
    _check_contiguous(op, "value_cache", value_cache)
    if slot_indices.dtype != torch.int32 or slot_indices.dim() != 1:
        _fail(op, f"slot_indices must be a 1-D int32 tensor, got {list(slot_indices.shape)} {slot_indices.dtype}")
    if slot_indices.shape[0] != key.shape[0]:
        _fail(op, f"slot_indices has {slot_indices.shape[0]} entries for {key.shape[0]} tokens")
    slots = slot_indices.to(torch.int64)
    total = num_blocks * block_size
    if bool((slots >= total).any()):
        _fail(op, f"slot_indices value {int(slots.max())} is out of range for a cache of {num_blocks} blocks of "
                  f"{block_size} ({total} slots)")
    keep = slots >= 0
    idx = slots[keep]
    if idx.numel() == 0:
        return
    uniq, counts = torch.unique(idx, return_counts=True)
    kflat = key_cache.view(total, kvn, key_cache.shape[3])
    vflat = value_cache.view(total, kvn, value_cache.shape[3])
    kflat.index_copy_(0, idx, key[keep])
    vflat.index_copy_(0, idx, value[keep])
    repeated = uniq[counts > 1]
    if repeated.numel():
        kflat[repeated] = float("nan")
        vflat[repeated] = float("nan")


#: Operators contributed to the simulated ``torch_npu`` (merged by ``npu_sim.ops``).
OPS: dict[str, Callable[..., Any]] = {
    "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
    "_npu_fused_infer_attention_score_get_max_workspace": _npu_fused_infer_attention_score_get_max_workspace,
    "npu_fused_infer_attention_score_v2": npu_fused_infer_attention_score_v2,
    "_npu_fused_infer_attention_score_v2_get_max_workspace": _npu_fused_infer_attention_score_v2_get_max_workspace,
    "_npu_reshape_and_cache": _npu_reshape_and_cache,
    "_npu_flash_attention": _npu_flash_attention,
    "_npu_flash_attention_qlens": _npu_flash_attention_qlens,
    "_npu_paged_attention": _npu_paged_attention,
    "_npu_paged_attention_get_workspace": _npu_paged_attention_get_workspace,
}
