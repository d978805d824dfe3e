"""MoE operators of the simulated ``torch_npu``, the FRACTAL_NZ format label, and vllm-ascend's ``_C_ascend`` MoE ops.

The family
==========
vllm-ascend's MoE layer is a pipeline of fused NPU operators (``docs/operators.md`` §4, §4.2, §2):

1. **gating** - ``npu_moe_gating_top_k_softmax`` (0.11.x, GPT-OSS path) or ``npu_moe_gating_top_k`` /
   ``torch.ops._C_ascend.moe_gating_top_k`` (0.13+): router logits -> top-k weights and expert ids;
2. **dispatch** - ``npu_moe_init_routing_v2`` / ``torch.ops._C_ascend.npu_moe_init_routing_custom`` (AllGather
   dispatcher), ``npu_moe_token_permute`` (All2All dispatcher), ``npu_moe_init_routing`` (v1, torchair path)
   + ``npu_moe_compute_expert_tokens``: sort the (token, k) slots by expert and count tokens per expert;
3. **expert MLP** - ``npu_grouped_matmul`` (one GEMM per expert over that expert's contiguous rows),
   ``npu_swiglu`` in between;
4. **combine** - ``npu_moe_token_unpermute`` (or ``npu_moe_finalize_routing``, torchair path): gather the rows back
   per token and sum them weighted by the routing probabilities.

Emulation rules (``docs/operators.md`` §2, ``docs/simulator.md`` §4): each operator follows the documented semantics (the
docstring names the source tag of ``docs/operators.md`` §1), computes in float32 and casts to the documented output
dtype, validates the documented limits vllm-ascend could violate and raises ``RuntimeError`` worded like the
operator's own check. Output memory the device leaves **uninitialised** is poisoned (NaN for floating outputs,
``INT_MIN`` for integer outputs), so code that reads it shows up in tests. Paths without CPU semantics here
(quantisation, drop/pad mode, K-grouped GEMM, ...) raise :class:`NotEmulatedError`.

FRACTAL_NZ
==========
On the device the format (ND = 2, FRACTAL_NZ = 29) is a property of the *storage*: torch_npu keeps it in
``NPUStorageImpl::npu_desc_`` and ``get_npu_format`` reads it from there (Ascend/pytorch FormatHelper /
``NPUBridge::GetNpuStorageImpl(t)->npu_desc_.npu_format_``). The simulator does the same out of band: the data stay
in the logical ND layout (values are never reshaped) and :data:`_FORMATS` maps the storage to its label. Consequences:

* ``torch.nn.Parameter(t)``, ``param.data = t``, ``.detach()``, ``.view``/``.transpose``/``.narrow`` all share
  the storage, so they all report the label - exactly what vllm-ascend's
  ``layer.w13_weight.data = npu_format_cast(layer.w13_weight.data, 29)`` followed by
  ``torch.nn.Parameter(...)`` and ``w1.transpose(1, 2)`` needs. A Python attribute on the tensor object would
  be lost by the Parameter re-wrap.
* Key = ``t.untyped_storage()._cdata`` (the ``StorageImpl`` address). In torch 2.13 the Python storage object
  is preserved for the whole life of the ``StorageImpl`` (``t.untyped_storage() is t.untyped_storage()``), and a
  ``weakref.finalize`` on it fires exactly when the last tensor using the storage is freed (verified by
  ``tests/unit/test_sim_moe.py::test_nz_label_does_not_survive_address_reuse``). The finalizer deletes the entry
  *before* the address can be handed out again, so a new ND tensor that reuses the memory never looks NZ, and the
  registry holds no strong reference (no leak). If a storage type refuses weak references, the registry keeps a
  strong reference instead (safe, but the storage then lives until relabelled ND).

Limits: only ``npu_format_cast`` / ``npu_format_cast_`` create NZ storages; every other op (``clone``,
``contiguous``, arithmetic, ...) yields a fresh ND storage, whereas real torch_npu may propagate a private format
through some of them. ``npu_format_cast_`` relabels the shared storage, so every alias of it changes format (the
real op swaps in a new storage for ``input`` only). Untracked tensors report ND (2) whatever their rank (real
torch_npu may report NCHW (0) for 4-D tensors - UNVERIFIED, vllm-ascend compares only against 2 and 29).

vllm-ascend's own ops
=====================
From 0.13.0 vllm-ascend calls ``torch.ops._C_ascend.moe_gating_top_k`` and
``torch.ops._C_ascend.npu_moe_init_routing_custom`` from its compiled library, which cannot load on CPU.
:func:`register_c_ascend_ops` defines them with the exact schemas of vllm-ascend 0.13.0 (``csrc/torch_binding.cpp``;
the strings are read from ``vllm_ascend_C.cpython-311-x86_64-linux-gnu.so`` of the 0.13.0 wheel and match the
repository source) and registers CPU kernels plus fake (meta) kernels, once, only if nobody defined them before.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from gptoss_patch_testkit.npu_sim._base import NotEmulatedError

__all__ = [
    "OPS",
    "ACL_FORMAT_ND",
    "ACL_FORMAT_FRACTAL_NZ",
    "register_c_ascend_ops",
    "C_ASCEND_SCHEMAS",
]

#: ``aclFormat`` values (OPD-fmt; vllm-ascend ``utils.py`` ``ACL_FORMAT_FRACTAL_ND/NZ``).
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
_SUPPORTED_FORMATS = (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_MAX = torch.iinfo(torch.int32).max
_INT32_POISON = torch.iinfo(torch.int32).min
_INT64_POISON = torch.iinfo(torch.int64).min
_GMM_INNER_LIMIT = 65536  # OPD-gmm "InnerLimit"
_GMM_MAX_GROUPS_TENSOR = 1024  # OTX-gmm MAX_GROUP_LIST_SIZE_TENSOR
_GMM_MAX_LIST_LEN = 128  # OPD-gmm: maximum list length of x / weight

_ACL_DTYPE_NAMES = {
    torch.bfloat16: "DT_BF16",
    torch.float16: "DT_FLOAT16",
    torch.float32: "DT_FLOAT",
    torch.int8: "DT_INT8",
    torch.int32: "DT_INT32",
    torch.int64: "DT_INT64",
}


def _acl_name(dtype: torch.dtype) -> str:
    return _ACL_DTYPE_NAMES.get(dtype, str(dtype))


def _poison_like_float(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Device memory the operator leaves uninitialised: NaN, so readers of it fail loudly - or, with
    ``GPTOSS_PATCH_SIM_UNINITIALISED=finite``, the dtype's largest finite value, which a read weighted by 0 cancels
    (``0 * max = 0``) and any other read turns into an overflow or a huge value.

    The finite setting exists for one upstream pattern: vllm-ascend's AllGather dispatcher at expert parallel (0.11.0
    ``ops/moe/token_dispatcher.py``) points every slot routed to another rank's expert at a row of the grouped
    matmul's output with probability 0, and that row may lie beyond the rows the group list covers - memory the
    operator never writes (docs/simulator.md §7). On the device it holds whatever was there, normally finite, so
    ``0 * garbage`` is 0 and the tokens come out right; a NaN or Inf left there by earlier work would poison them.

    Raises:
        ValueError: ``GPTOSS_PATCH_SIM_UNINITIALISED`` is neither ``nan`` nor ``finite``.
    """
    from gptoss_patch_testkit import config

    if config.choice(config.SIM_UNINITIALISED) == "finite":
        return torch.full(tuple(shape), torch.finfo(dtype).max, dtype=dtype)
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------------
# FRACTAL_NZ format label (docs/operators.md §4.2)
# ---------------------------------------------------------------------------------------------------------------------


class _FormatRegistry:
    """Storage -> ACL format label, cleared when the storage is freed (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a finalizer may run (GC) while this thread holds the lock
        self._formats: dict[int, int] = {}
        self._watched: dict[int, Any] = {}  # key -> weakref.finalize, or the storage itself as a fallback

    @staticmethod
    def _storage(t: torch.Tensor) -> Any:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        return t.untyped_storage()

    def get(self, t: torch.Tensor) -> int:
        key = self._storage(t)._cdata
        with self._lock:
            return self._formats.get(key, ACL_FORMAT_ND)

    def set(self, t: torch.Tensor, fmt: int) -> None:
        storage = self._storage(t)
        key = storage._cdata
        with self._lock:
            if fmt == ACL_FORMAT_ND:
                self._formats.pop(key, None)
                return
            if key not in self._watched:
                try:
                    self._watched[key] = weakref.finalize(storage, self._forget, key)
                except TypeError:  # storage type without weak references: keep it alive instead
                    self._watched[key] = storage
            self._formats[key] = fmt

    def _forget(self, key: int) -> None:
        with self._lock:
            self._formats.pop(key, None)
            self._watched.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._formats)


#: The process-wide format table of the simulator.
_FORMATS = _FormatRegistry()


def _format_value(acl_format: Any) -> int:
    try:
        return int(acl_format)  # int or torch_npu.Format (an IntEnum on the device)
    except (TypeError, ValueError):
        raise TypeError(f"acl_format must be an int or torch_npu.Format, got {acl_format!r}") from None


def get_npu_format(t: torch.Tensor) -> int:
    """Return the ACL storage format of ``t``: 29 (FRACTAL_NZ) if its storage was cast to NZ, else 2 (ND).

    Args:
        t: any tensor; views and ``Parameter`` wrappers report the format of the storage they share.

    Returns:
        ``int`` - 2 or 29.

    Raises:
        TypeError: ``t`` is not a tensor.

    Source: OPD-fmt (``get_npu_format`` reads the storage's ``npu_desc_``); docs/operators.md §4.2 "emulator advice".
    """
    return _FORMATS.get(t)


def npu_format_cast(input: torch.Tensor, acl_format: Any, customize_dtype: Any = None) -> torch.Tensor:  # noqa: A002
    """Return ``input`` in storage format ``acl_format`` (2 = ND, 29 = FRACTAL_NZ); ``input`` is not modified.

    The result has the same logical shape, dtype and values (the NZ fractal layout pads the *storage*, never the
    logical tensor: PT-fmt ``InferShapeNDToNZ``; HIA-transdata). If ``input`` already has that format it is returned
    as is; otherwise a new contiguous tensor with its own storage is returned and labelled.

    Args:
        input: tensor of any dtype/shape.
        acl_format: ``int`` or ``torch_npu.Format``; only 2 and 29 are emulated.
        customize_dtype: must be ``None`` (only CANN >= 9.1.0 accepts it, OPD-fmt constraints).

    Returns:
        Tensor with ``get_npu_format(result) == acl_format``.

    Raises:
        NotEmulatedError: another format, or ``customize_dtype`` given.

    Source: OPD-fmt (``npu_format_cast(input, acl_format, customize_dtype=None)``); docs/operators.md §4.2.
    """
    fmt = _format_value(acl_format)
    if customize_dtype is not None:
        raise NotEmulatedError("torch_npu.npu_format_cast(customize_dtype=...) is not emulated (CANN >= 9.1.0 only)")
    if fmt not in _SUPPORTED_FORMATS:
        raise NotEmulatedError(f"torch_npu.npu_format_cast to ACL format {fmt} is not emulated (only 2=ND, 29=FRACTAL_NZ)")
    if get_npu_format(input) == fmt:
        return input
    out = torch.empty_like(input, memory_format=torch.contiguous_format).copy_(input)
    _FORMATS.set(out, fmt)
    return out


def npu_format_cast_(input: torch.Tensor, src: Any, customize_dtype: Any = None) -> torch.Tensor:  # noqa: A002
    """In-place format cast: relabel the storage of ``input`` as ``src``'s format; returns ``input``.

    Args:
        input: tensor to relabel (all aliases of its storage change with it - see module "Limits").
        src: ``int``/``torch_npu.Format`` target format, or a tensor whose format is copied.
        customize_dtype: must be ``None``.

    Returns:
        ``input``.

    Raises:
        NotEmulatedError: a format other than 2/29, or ``customize_dtype`` given.

    Source: OPD-fmt (``npu_format_cast_(input, src, customize_dtype=None)``); vllm-ascend calls it for quantized
    MoE weights (VA@v0.11.0 quantization/w8a8_dynamic.py).
    """
    fmt = get_npu_format(src) if isinstance(src, torch.Tensor) else _format_value(src)
    if customize_dtype is not None:
        raise NotEmulatedError("torch_npu.npu_format_cast_(customize_dtype=...) is not emulated (CANN >= 9.1.0 only)")
    if fmt not in _SUPPORTED_FORMATS:
        raise NotEmulatedError(f"torch_npu.npu_format_cast_ to ACL format {fmt} is not emulated (only 2=ND, 29=FRACTAL_NZ)")
    _FORMATS.set(input, fmt)
    return input


# ---------------------------------------------------------------------------------------------------------------------
# npu_grouped_matmul (docs/operators.md §4.1, §4.2)
# ---------------------------------------------------------------------------------------------------------------------


def _is_transposed_last_two(t: torch.Tensor) -> bool:
    """OTX-gmm ``IsTransposeLastTwoDims``: the last two dims are stored swapped (strides ``[.., 1, rows]``)."""
    if t.dim() < 2 or t.is_contiguous():
        return False
    rows, cols = t.size(-2), t.size(-1)
    return t.stride(-2) == 1 and t.stride(-1) == rows and rows > 1 and cols > 1


def _check_nz_weights(weights: Sequence[torch.Tensor]) -> None:
    """OTX-gmm ``TransWeightToNz`` / ``TransWeightToNzCheckAlign``: NZ weights need (k, n) aligned to the fractal."""
    for w in weights:
        if get_npu_format(w) != ACL_FORMAT_FRACTAL_NZ:
            break  # the operator stops at the first non-NZ weight, as the kernel source does
        k, n = int(w.size(-2)), int(w.size(-1))
        if w.dtype in (torch.bfloat16, torch.float16):
            aligned = k % 16 == 0 and n % 16 == 0
        else:  # no alignment rule matches: the check fails for every other non-quantised dtype (fp32 included)
            aligned = False
        if not aligned:
            raise RuntimeError(
                "npu_grouped_matmul: call aclnnGroupedMatmulWeightNz failed: "
                f"When weight({_acl_name(w.dtype)}) format is FRACTAL_NZ, weight'shape(k[{k}], n[{n}]) should be "
                "divisible by the following shape: INT8:[16, 32],BF16/FP16[16, 16],INT4[16, 64]). If the weight is "
                "transposed,the k/n need to be reversed. (ACLNN_ERR_PARAM_INVALID)"
            )


def _gmm_group_bounds(group_list: torch.Tensor, group_list_type: int, total_rows: int) -> list[tuple[int, int]]:
    values = [int(v) for v in group_list.reshape(-1).tolist()]
    bounds: list[tuple[int, int]] = []
    start = 0
    if group_list_type == 0:
        for i, end in enumerate(values):
            if end < start:
                raise RuntimeError(
                    f"npu_grouped_matmul: group_list (group_list_type=0, cumulative) must be non-negative and "
                    f"non-decreasing, but group_list[{i}]={end} < {start}"
                )
            bounds.append((start, end))
            start = end
    else:
        for i, count in enumerate(values):
            if count < 0:
                raise RuntimeError(
                    f"npu_grouped_matmul: group_list (group_list_type=1, counts) must be non-negative, "
                    f"but group_list[{i}]={count}"
                )
            bounds.append((start, start + count))
            start += count
    if start > total_rows:
        # The device does not check this (the values live on the device); it would read past x. Simulator guard.
        raise RuntimeError(
            f"npu_grouped_matmul: group_list covers {start} rows but x has only {total_rows} "
            f"(group_list_type={group_list_type}); the kernel would read out of bounds"
        )
    return bounds


def _gmm_one(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    y = torch.matmul(x.float(), w.float())
    if b is not None:
        y = y + b.float()
    return y.to(out_dtype)


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | Sequence[int] | None = None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Grouped GEMM ``y_i = x_i @ weight_i + bias_i`` (non-quantised), returned as a **list** of tensors.

    Emulated scenarios (OPD-gmm "supported scenarios"; OPC-gmm output allocation):

    * ``group_type=0`` (group the M/token axis), single ``x = [X (M, K)]``, ``group_list`` required:

      - single 3-D ``weight = [W (E, K, N)]`` (or a transposed view with strides ``[.., 1, K]``) or ``E`` 2-D weights
        ``[W_e (K, N)]``; group ``e`` covers rows ``[start_e, end_e)`` of ``X``;
      - ``split_item`` 2/3: one output ``(M, N)``, ``y[r] = X[r] @ W_e + bias[e]``; rows past the covered total are
        **uninitialised on the device** (OPC-gmm ``create_new_tensor``) and come back as NaN here;
      - ``split_item`` 0/1: one output per group, ``(end_e - start_e, N_e)``.
    * ``group_type=0`` with several ``x`` tensors ``[x_i (m_i, K)]``: ``y_i = x_i @ W_i``; ``split_item`` 2/3
      concatenates along rows, 0/1 returns the list; an optional ``group_list`` must match the ``m_i``.
    * ``group_type=-1`` (no grouping), ``split_item`` 0/1: ``y_i = x_i @ W_i`` with 2-D..6-D ``x_i``.

    ``group_list``: 1-D int64 tensor with one entry per group (E <= 1024; OTX-gmm ``CheckGroupListCommonTensor``);
    ``group_list_type`` 0 = cumulative end offsets (non-decreasing), 1 = per-group counts. A ``list[int]`` selects
    the legacy overload and is read as cumulative offsets.

    Args:
        x: list of float16/bfloat16/float32 tensors (not transposed).
        weight: list of weights, dtype equal to x's.
        bias: ``None`` or one tensor per weight tensor: ``(E, N)`` for a single 3-D weight, ``(N_i,)`` otherwise;
            dtype **float32 when x is bfloat16**, else x's dtype (OTX-gmm ``biasDtype``; OPD-gmm data-type tables).
        group_list, split_item, group_type, group_list_type: see above.
        output_dtype: ``None`` or x's dtype.
        scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
        activation_quant_scale, activation_quant_offset, act_type: quantisation/activation inputs; must be unset.
        tuning_config: performance hint, ignored.

    Returns:
        ``list[Tensor]`` in x's dtype (one tensor for ``split_item`` 2/3).

    Raises:
        RuntimeError: ``group_type`` not passed or not in {-1, 0, 2}; ``split_item`` not in 0..3; ``split_item``
            2/3 with ``group_type=-1``; dtype mismatches (``"GMM: bias dtype does not match with required
            dtype[DT_FLOAT]."``); bias/group_list shape or length mismatches; ``group_list_type=2`` (int8 only);
            K of x and weight differ; a last dim >= 65536 (``InnerLimit``); transposed x; an NZ weight whose
            ``k`` or ``n`` is not a multiple of 16 (bf16/fp16) or any NZ fp32 weight (OTX-gmm ``TransWeightToNz``,
            docs/operators.md §4.2); ``group_list`` not monotone / covering more rows than x (simulator guard).
        NotEmulatedError: quantisation / activation arguments, ``group_type=2`` (K grouping), int8/int4 inputs,
            ``split_item`` 0/1 with ``group_list_type=1``.

    Source: OPD-gmm; OPY72 schema; OPC-gmm (``check_dims``, output allocation, NZ dispatch on ``weight[0]``);
    OTX-gmm ``CheckOptionalTensorList``, ``CheckNonQuantMatmulDataType``, ``CheckGroupListCommonTensor``,
    ``TransWeightToNzCheckAlign``; docs/operators.md §4.1, §4.2.
    """
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError("npu_grouped_matmul: x and weight must be lists of tensors")
    if len(x) == 0 or len(weight) == 0:
        raise RuntimeError("npu_grouped_matmul: Invalid inputs: neither x nor weight could be empty.")
    for name, value in (("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
                        ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
                        ("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset)):
        if value is not None and len(value) > 0:
            raise NotEmulatedError(f"torch_npu.npu_grouped_matmul({name}=...) (quantised GMM) is not emulated")
    if act_type not in (None, 0):
        raise NotEmulatedError(f"torch_npu.npu_grouped_matmul(act_type={act_type}) is not emulated")

    legacy_list = isinstance(group_list, (list, tuple))
    if legacy_list:  # the List[int] overload: cumulative offsets, no group_type
        group_list = torch.tensor(list(group_list), dtype=torch.int64)
        group_list_type = 0
        group_type = 0 if len(group_list) else -1
    if group_type is None:
        raise RuntimeError("npu_grouped_matmul: Requires manual passing group_type, current is None.")
    if group_type not in (-1, 0, 2):
        raise RuntimeError(f"npu_grouped_matmul: The group type must be -1, 0 or 2, but now is [{group_type}]")
    if group_type == 2:
        raise NotEmulatedError("torch_npu.npu_grouped_matmul(group_type=2) (K-axis grouping) is not emulated")
    split = 0 if split_item is None else int(split_item)
    if split not in (0, 1, 2, 3):
        raise RuntimeError(f"npu_grouped_matmul: Invalid value of split_item [{split}], which should only be one of 0/1/2/3.")
    if split in (2, 3) and group_type == -1:
        raise RuntimeError("npu_grouped_matmul: When splitItem is 2/3, groupType can not be -1.")
    glt = 0 if group_list_type is None else int(group_list_type)

    x_dtype = x[0].dtype
    if x_dtype not in _FLOAT_DTYPES:
        raise NotEmulatedError(f"torch_npu.npu_grouped_matmul with x dtype {x_dtype} (quantised GMM) is not emulated")
    for t in x:
        if t.dtype != x_dtype:
            raise RuntimeError(f"npu_grouped_matmul: GMM: x dtype does not match with required dtype[{_acl_name(x_dtype)}].")
    for w in weight:
        if w.dtype != x_dtype:
            raise RuntimeError(
                f"npu_grouped_matmul: GMM: weight dtype does not match with required dtype[{_acl_name(x_dtype)}].")
    out_dtype = x_dtype if output_dtype is None else output_dtype
    if out_dtype != x_dtype:
        raise RuntimeError(f"npu_grouped_matmul: GMM: y dtype does not match with required dtype[{_acl_name(x_dtype)}].")
    if len(x) > _GMM_MAX_LIST_LEN or len(weight) > _GMM_MAX_LIST_LEN:
        raise RuntimeError(f"npu_grouped_matmul: the maximum list length of x and weight is {_GMM_MAX_LIST_LEN}")

    single_weight = len(weight) == 1 and weight[0].dim() == 3
    if single_weight:
        num_groups = int(weight[0].size(0))
        w_list = list(weight[0].unbind(0))
    else:
        for i, w in enumerate(weight):
            if w.dim() != 2:
                raise RuntimeError(f"npu_grouped_matmul: weight[{i}] dim num should be 2 in this case, but now is {w.dim()}.")
        num_groups = len(weight)
        w_list = list(weight)
    transposed = [_is_transposed_last_two(w) for w in weight]
    if any(t != transposed[0] for t in transposed):
        raise RuntimeError("npu_grouped_matmul: The transpose state must be the same for each tensor in weight.")

    # group_list checks (OTX-gmm CheckGroupListCommonTensor; OPD-gmm group_list_type)
    if group_list is not None:
        if not isinstance(group_list, torch.Tensor):
            raise TypeError("npu_grouped_matmul: group_list must be a Tensor or a list of ints")
        if glt == 2:
            raise RuntimeError(
                "npu_grouped_matmul: group_list_type=2 ([[group_idx, count], ...]) is supported only when x and "
                f"weight are INT8 and group_type is 0, but x is {_acl_name(x_dtype)}")
        if glt not in (0, 1):
            raise RuntimeError(f"npu_grouped_matmul: groupListType shoule be 0 or 1, but got {glt}.")
        if group_list.dim() != 1:
            raise RuntimeError(f"npu_grouped_matmul: group_list must be 1-D, but got {group_list.dim()}-D")
        if group_list.dtype != torch.int64:
            raise RuntimeError("npu_grouped_matmul: Invalid dtype: Only int64 is supported for groupList.")
        n_list = int(group_list.size(0))
        if n_list > _GMM_MAX_GROUPS_TENSOR:
            raise RuntimeError(
                f"npu_grouped_matmul: When groupList type is tenosr, size of groupList {n_list} should be less than "
                f"or equal to {_GMM_MAX_GROUPS_TENSOR}.")
        if num_groups > 1 and n_list != num_groups:
            raise RuntimeError(
                f"npu_grouped_matmul: When groupList is not null, size of groupList(tensor) {n_list} should be equal "
                f"to weight dim 0 {num_groups} with groupType {group_type}.")
    if len(x) > 1 and len(x) != num_groups:
        raise RuntimeError(
            f"npu_grouped_matmul: When x and weight are separated, size of x {len(x)} should equal to size of weight "
            f"{num_groups}.")
    if split in (0, 1):  # OPC-gmm check_dims
        if group_list is not None:
            if not (len(x) == 1 and num_groups == int(group_list.size(0))):
                raise RuntimeError(
                    "npu_grouped_matmul: Invalid inputs. When split_item = 0 or 1 and input group_list is not None, "
                    "the following two conditions are supposed to be satisfied: (1) length of x equals 1; (2) length "
                    f"of weight equals that of group_list. Actual lengths: x [{len(x)}], weight [{num_groups}], "
                    f"group_list [{int(group_list.size(0))}].")
            if glt == 1:
                raise NotEmulatedError(
                    "torch_npu.npu_grouped_matmul(split_item=0/1, group_list_type=1): torch_npu sizes the split outputs "
                    "from group_list as cumulative offsets; this combination has no coherent CPU semantics")
        elif len(x) != num_groups:
            raise RuntimeError(
                "npu_grouped_matmul: When split_item = 0 or 1 and input group_list is None, the num of x tensors must "
                f"equal the num of weight tensors.Actual lengths: x [{len(x)}], weight [{num_groups}].")

    # bias checks (OTX-gmm CheckOptionalTensorList, CheckNonQuantMatmulDataType)
    b_list: list[torch.Tensor | None] = [None] * num_groups
    if bias is not None and len(bias) > 0:
        required = torch.float32 if x_dtype == torch.bfloat16 else x_dtype
        if len(bias) != len(weight):
            raise RuntimeError(f"npu_grouped_matmul: bias size[{len(bias)}] must be equal with weight size[{len(weight)}].")
        for b in bias:
            if b.dtype != required:
                raise RuntimeError(
                    f"npu_grouped_matmul: GMM: bias dtype does not match with required dtype[{_acl_name(required)}].")
        if single_weight:
            b0 = bias[0]
            if b0.dim() != 2:
                raise RuntimeError(f"npu_grouped_matmul: bias Dim must be 2, but now is {b0.dim()}.")
            if int(b0.size(0)) != num_groups:
                raise RuntimeError(
                    f"npu_grouped_matmul: bias batch size[{int(b0.size(0))}] should be euqal with groupList length[{num_groups}].")
            if int(b0.size(-1)) != int(weight[0].size(-1)):
                raise RuntimeError(
                    f"npu_grouped_matmul: NDim[{int(b0.size(-1))}] of bias should be equal with NDim[{int(weight[0].size(-1))}] of weight.")
            b_list = list(b0.unbind(0))
        else:
            for i, (b, w) in enumerate(zip(bias, weight)):
                if b.dim() != 1:
                    raise RuntimeError(f"npu_grouped_matmul: bias Dim must be 1, but now is {b.dim()}.")
                if int(b.size(0)) != int(w.size(-1)):
                    raise RuntimeError(
                        f"npu_grouped_matmul: NDim[{int(b.size(0))}] of bias[{i}] should be equal with NDim[{int(w.size(-1))}] of weight[{i}].")
            b_list = list(bias)

    # shape checks
    for i, t in enumerate(x):
        if t.dim() < 2 or (split in (2, 3) or group_type == 0) and t.dim() != 2:
            raise RuntimeError(f"npu_grouped_matmul: x[{i}] dim num should be 2 in this case, but now is {t.dim()}.")
        if t.dim() == 2 and _is_transposed_last_two(t):
            raise RuntimeError("npu_grouped_matmul: x does not support transposition.")
    for i, w in enumerate(w_list):
        xi = x[0] if len(x) == 1 else x[min(i, len(x) - 1)]
        if int(xi.size(-1)) != int(w.size(-2)):
            raise RuntimeError(
                f"npu_grouped_matmul: k dim value of x and weight is not matched (x K={int(xi.size(-1))}, "
                f"weight[{i}] K={int(w.size(-2))}).")
        inner = int(w.size(-2)) if transposed[0] else int(w.size(-1))
        if inner >= _GMM_INNER_LIMIT:
            raise RuntimeError(f"npu_grouped_matmul: the last dim of weight ({inner}) must be less than InnerLimit {_GMM_INNER_LIMIT}")
    for t in x:
        if int(t.size(-1)) >= _GMM_INNER_LIMIT:
            raise RuntimeError(f"npu_grouped_matmul: the last dim of x ({int(t.size(-1))}) must be less than InnerLimit {_GMM_INNER_LIMIT}")
    if split in (2, 3):
        n0 = int(w_list[0].size(-1))
        if any(int(w.size(-1)) != n0 for w in w_list):
            raise RuntimeError("npu_grouped_matmul: The N-axis size of each tensor in weight must be identical.")

    # NZ weights (OPC-gmm dispatches to aclnnGroupedMatmulWeightNz when weight[0] is NZ)
    if get_npu_format(weight[0]) == ACL_FORMAT_FRACTAL_NZ:
        _check_nz_weights(w_list if not single_weight else [weight[0]])

    # compute
    if group_type == -1 or len(x) > 1:
        if group_list is not None and len(x) > 1:
            sizes = [int(t.size(0)) for t in x]
            bounds = _gmm_group_bounds(group_list, glt, sum(sizes))
            if [e - s for s, e in bounds] != sizes:
                raise RuntimeError(
                    f"npu_grouped_matmul: group_list {group_list.tolist()} does not match the rows of the x tensors {sizes}")
        outs = [_gmm_one(xi, w_list[i], b_list[i], out_dtype) for i, xi in enumerate(x)]
        if split in (2, 3):
            return [torch.cat(outs, dim=0)]
        return outs

    # single x, grouped along M
    if group_list is None:
        raise RuntimeError("npu_grouped_matmul: groupListOptional(tensor) is required in this case, but get nullptr.")
    x0 = x[0]
    m = int(x0.size(0))
    bounds = _gmm_group_bounds(group_list, glt, m)
    if split in (2, 3):
        y = _poison_like_float((m, int(w_list[0].size(-1))), out_dtype)
        for e, (s, t) in enumerate(bounds):
            if t > s:
                y[s:t] = _gmm_one(x0[s:t], w_list[e], b_list[e], out_dtype)
        return [y]
    return [_gmm_one(x0[s:t], w_list[e], b_list[e], out_dtype) for e, (s, t) in enumerate(bounds)]


# ---------------------------------------------------------------------------------------------------------------------
# npu_swiglu (docs/operators.md §4.3)
# ---------------------------------------------------------------------------------------------------------------------


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # noqa: A002
    """SwiGLU on halves: ``[A | B] = split(input, 2, dim)``, ``out = A * sigmoid(A) * B``.

    A is the **first** half (the gate), B the second; this is *not* GPT-OSS's interleaved, clamped
    ``swigluoai`` (see :mod:`gptoss_patch.kernels.moe`).

    Args:
        input: float16/bfloat16/float32 tensor whose size along ``dim`` is even.
        dim: split dimension.

    Returns:
        Tensor of ``input``'s dtype with ``input.size(dim) // 2`` along ``dim`` (computed in float32).

    Raises:
        RuntimeError: unsupported dtype, or odd size along ``dim``.

    Source: OPD-swiglu; OPY72 ``npu_swiglu(Tensor self, int dim=-1)``; docs/operators.md §4.3.
    """
    if input.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"npu_swiglu: input dtype must be float16, bfloat16 or float32, got {input.dtype}")
    size = int(input.size(dim))
    if size % 2 != 0:
        raise RuntimeError(f"npu_swiglu: the size of input along dim {dim} must be even, but got {size}")
    a, b = input.float().chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(input.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# gating (docs/operators.md §4.3)
# ---------------------------------------------------------------------------------------------------------------------


def npu_moe_gating_top_k_softmax(
    x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y, expert_idx = topk(softmax(x, -1), k)`` with column-major ``row_idx``.

    Args:
        x: ``(R, E)`` or ``(B, S, E)`` float16/bfloat16/float32 router logits.
        finished: optional bool tensor of shape ``x.shape[:-1]``; rows with ``True`` get expert id ``E``.
        k: ``0 < k <= E`` and ``k <= 1024``.

    Returns:
        ``(y, expert_idx, row_idx)``, each of shape ``x.shape[:-1] + (k,)``: ``y`` in x's dtype (softmax computed
        in float32), ``expert_idx`` int32, ``row_idx`` int32 with ``row_idx[r, c] = c * R + r`` (``R`` = number of
        rows, leading dims flattened).

    Order within the top-k: **descending** probability, ties broken by the lower expert id. UNVERIFIED on hardware:
    the documentation does not state the order (docs/operators.md §4.3); it follows op-plugin's golden test
    (OPT-test_npu_moe_gating_top_k_softmax.py: ``argsort(-softmax, kind='stable')[:, :k]``, compared exactly with
    the device output). vllm-ascend renormalises the weights itself, which is order-independent.

    Raises:
        RuntimeError: wrong rank/dtype, ``k`` out of range, ``finished`` of the wrong shape/dtype.

    Source: OPD-gts; OTX-moe moe_gating_top_k_softmax README; OPMETA shapes; docs/operators.md §4.3.
    """
    if x.dim() not in (2, 3):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: the x shape support only 2d and 3d, got {x.dim()}d")
    if x.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    num_experts = int(x.size(-1))
    if not (0 < k <= num_experts and k <= 1024):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: k must satisfy 0 < k <= {num_experts} and k <= 1024, got {k}")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, num_experts)
    rows = int(x2.size(0))
    probs = torch.softmax(x2.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    y = probs.gather(1, order).to(x.dtype)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        if finished.dtype != torch.bool or tuple(finished.shape) != lead:
            raise RuntimeError(
                f"npu_moe_gating_top_k_softmax: finished must be a bool tensor of shape {lead}, "
                f"got {finished.dtype} {tuple(finished.shape)}")
        expert_idx = torch.where(finished.reshape(-1, 1), torch.full_like(expert_idx, num_experts), expert_idx)
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).t().contiguous()
    return y.reshape(lead + (k,)), expert_idx.reshape(lead + (k,)), row_idx.reshape(lead + (k,))


def _gating_top_k(
    x: torch.Tensor, k: int, bias: torch.Tensor | None, k_group: int, group_count: int, group_select_mode: int,
    renorm: int, norm_type: int, out_flag: bool, routed_scaling_factor: float, eps: float, *, op: str,
    allowed_renorm: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise RuntimeError(f"{op}: The x should be 2D")
    if x.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"{op}: float16、float32 or bfloat16 tensor expected but got a tensor with dtype: {x.dtype}")
    rows, num_experts = int(x.size(0)), int(x.size(1))
    if bias is not None:
        if bias.dtype != x.dtype:
            raise RuntimeError(f"{op}: The dtype of x and bias should be same")
        if bias.dim() != 1:
            raise RuntimeError(f"{op}: The bias should be 1D")
        if int(bias.size(0)) != num_experts:
            raise RuntimeError(f"{op}: The bias first dim should be same as x second dim")
    if num_experts > 2048:
        raise RuntimeError(f"{op}: expert count is: {num_experts}, but should not greater than 2048.")
    if k <= 0:
        raise RuntimeError(f"{op}: k is: {k}, but should be greater than 0.")
    if k > num_experts:
        raise RuntimeError(f"{op}: k is: {k}, expert num is: {num_experts}, k cannot be greater than expert num.")
    if k_group <= 0 or group_count <= 0:
        raise RuntimeError(f"{op}: k_group ({k_group}) and group_count ({group_count}) should be greater than 0.")
    if k_group > group_count:
        raise RuntimeError(f"{op}: k_group is: {k_group}, but should not greater than {group_count}.")
    if norm_type not in (0, 1):
        raise RuntimeError(f"{op}: norm type is: {norm_type}, but currently only support 0 and 1.")
    if group_select_mode not in (0, 1):
        raise RuntimeError(f"{op}: group select mode is: {group_select_mode}, but currently only support 1 and 0.")
    if renorm not in allowed_renorm:
        raise RuntimeError(f"{op}: renorm is: {renorm}, but currently only support {', '.join(map(str, allowed_renorm))}.")
    if num_experts % group_count != 0:
        raise RuntimeError(f"{op}: Expert count : {num_experts} is not divisible by k_group: {group_count}")
    per_group = num_experts // group_count
    if group_select_mode == 1 and per_group < 2:
        raise RuntimeError(
            f"{op}: group expert count is: {per_group}, if group select mode is: 1, group expert count should be greater than 1.")
    if k > k_group * per_group:
        raise RuntimeError(f"{op}: k is: {k}, but should be smaller than {k_group * per_group}.")

    xf = x.float()
    norm = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    select = norm + bias.float() if bias is not None else norm.clone()
    if group_count > 1 and k_group < group_count:
        grouped = select.reshape(rows, group_count, per_group)
        if group_select_mode == 0:
            group_score = grouped.max(dim=-1).values
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
        mask = torch.zeros(rows, group_count, dtype=torch.bool).scatter_(1, keep, True)
        select = select.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
    idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1 or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm if out_flag else _poison_like_float((rows, num_experts), torch.float32)
    return y.to(x.dtype), idx.to(torch.int32), out


def npu_moe_gating_top_k(
    x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None, k_group: int = 1, group_count: int = 1,
    group_select_mode: int = 0, renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
    routed_scaling_factor: float = 1.0, eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped top-k expert selection on softmax (``norm_type=0``) or sigmoid (``norm_type=1``) scores.

    1. ``norm = softmax(x)`` or ``sigmoid(x)`` (float32); 2. selection score ``s = norm + bias`` (bias only affects
    *which* experts are chosen); 3. if ``group_count > 1``: split the experts into ``group_count`` groups, score each
    by its max (``group_select_mode=0``) or the sum of its top-2 (``=1``), keep the best ``k_group`` groups;
    4. ``expert_idx = topk(s, k)`` (descending; UNVERIFIED tie order: lower id first), ``y = norm[expert_idx]``;
    5. sigmoid: ``y /= sum(y) + eps``; 6. ``y *= routed_scaling_factor``.

    Args:
        x: ``(R, E)`` float16/bfloat16/float32, ``E <= 2048``, ``E % group_count == 0``.
        k: ``1 <= k <= E / group_count * k_group``.
        bias: optional ``(E,)`` of x's dtype.
        k_group, group_count, group_select_mode, norm_type: as above.
        renorm: must be 0 (aclnnMoeGatingTopK: "renorm仅支持0").
        out_flag: whether the third output (``norm``, float32 ``(R, E)``) is produced; otherwise it is uninitialised
            (NaN here).
        routed_scaling_factor, eps: as above.

    Returns:
        ``(y (R, k) in x's dtype, expert_idx (R, k) int32, out (R, E) float32)``.

    Raises:
        RuntimeError: the limits listed above (worded like the op-plugin / tiling checks).

    The per-product limits of older documentation (A2/A3: ``E == 256``, ``k_group == 4``, bias required) are not
    enforced. Source: OPD-gtk (equivalent code: norm_type 0 = softmax, 1 = sigmoid; division only for sigmoid);
    OPY72 schema; OPMETA; aclnnMoeGatingTopK doc (CANN 8.5); docs/operators.md §4.3.
    """
    return _gating_top_k(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                         routed_scaling_factor, eps, op="npu_moe_gating_top_k", allowed_renorm=(0,))


def c_ascend_moe_gating_top_k(
    x: torch.Tensor, k: int, k_group: int, group_count: int, group_select_mode: int, renorm: int, norm_type: int,
    out_flag: bool, routed_scaling_factor: float, eps: float, bias_opt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU kernel of ``torch.ops._C_ascend.moe_gating_top_k`` (vllm-ascend >= 0.13 custom op).

    Same computation as :func:`npu_moe_gating_top_k`, plus ``renorm=1`` (``RENORM_L1``): the selected weights are
    divided by their sum (+ ``eps``) for softmax too. vllm-ascend 0.13 passes ``renorm=int(renormalize)`` and
    ``norm_type=0`` for softmax routers, so GPT-OSS gets ``softmax(x)[top-k] / sum`` = ``softmax(topk(x))``.
    UNVERIFIED: whether ``eps`` is added in the softmax + L1 case (irrelevant at 1e-20).

    Args/Returns/Raises: as :func:`npu_moe_gating_top_k`, positional order of the schema
    ``moe_gating_top_k(Tensor x, int k, int k_group, int group_count, int group_select_mode, int renorm,
    int norm_type, bool out_flag, float routed_scaling_factor, float eps, Tensor? bias_opt=None)``;
    ``renorm`` may be 0 or 1.

    Source: VA@v0.13.0 csrc/torch_binding.cpp (schema), csrc/moe_gating_top_k/op_host/moe_gating_top_k_tiling.cpp
    (``RENORM_NO = 0``, ``RENORM_L1 = 1``, checks), csrc/torch_binding_meta.cpp (shapes/dtypes);
    VA@v0.13.0 ops/fused_moe/experts_selector.py (call site); docs/operators.md §4.3.
    """
    return _gating_top_k(x, k, bias_opt, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                         routed_scaling_factor, eps, op="moe_gating_top_k", allowed_renorm=(0, 1))


# ---------------------------------------------------------------------------------------------------------------------
# dispatch: init routing (docs/operators.md §4.3)
# ---------------------------------------------------------------------------------------------------------------------


def npu_moe_init_routing(
    x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing v1: sort the (row, k) slots by expert and gather the token rows in that order.

    With ``order = stable_argsort(expert_idx.flatten())`` (row-major flattening, ``j = r * K + k``):
    ``expanded_expert_idx = expert_idx.flatten()[order]``, ``sorted_row = row_idx.flatten()[order]``,
    ``expanded_row_idx[sorted_row[i]] = i``, ``expanded_x[i] = x[sorted_row[i] % R]`` for
    ``i < min(R, active_num) * K``.

    Args:
        x: ``(R, H)`` float16/bfloat16/float32.
        row_idx: ``(R, K)`` int32, normally ``row_idx[r, k] = k * R + r`` (the third output of
            :func:`npu_moe_gating_top_k_softmax`).
        expert_idx: ``(R, K)`` int32.
        active_num: maximum number of rows processed.

    Returns:
        ``(expanded_x (min(R, active_num) * K, H) x.dtype, expanded_row_idx (R*K,) int32,
        expanded_expert_idx (R*K,) int32)``.

    Raises:
        RuntimeError: wrong ranks, shapes or dtypes.

    Source: OPD-mir (formula and equivalent code); OTX-moe moe_init_routing README; docs/operators.md §4.3.
    """
    op = "npu_moe_init_routing"
    if x.dim() != 2:
        raise RuntimeError(f"{op}: x must be 2-D (NUM_ROWS, H), got {x.dim()}-D")
    if x.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"{op}: x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if expert_idx.dim() != 2 or tuple(row_idx.shape) != tuple(expert_idx.shape):
        raise RuntimeError(f"{op}: row_idx and expert_idx must both be (NUM_ROWS, K), got {tuple(row_idx.shape)} "
                           f"and {tuple(expert_idx.shape)}")
    if expert_idx.dtype != torch.int32 or row_idx.dtype != torch.int32:
        raise RuntimeError(f"{op}: row_idx and expert_idx must be int32")
    rows, k = int(expert_idx.size(0)), int(expert_idx.size(1))
    if rows != int(x.size(0)):
        raise RuntimeError(f"{op}: expert_idx has {rows} rows but x has {int(x.size(0))}")
    flat = expert_idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    expanded_expert_idx = flat[order].to(torch.int32)
    sorted_row = row_idx.reshape(-1).long()[order]
    expanded_row_idx = torch.zeros(rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_row] = torch.arange(rows * k, dtype=torch.int32)
    n_out = min(int(active_num), rows) * k
    expanded_x = x[sorted_row[:n_out] % max(rows, 1)].clone()
    return expanded_x, expanded_row_idx, expanded_expert_idx


def _init_routing_v2(
    op: str, x: torch.Tensor, expert_idx: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
    active_num: int, expert_capacity: int, expert_num: int, drop_pad_mode: int, expert_tokens_num_type: int,
    expert_tokens_num_flag: bool, quant_mode: int, active_expert_range: Sequence[int] | None, row_idx_type: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if quant_mode != -1:
        raise NotEmulatedError(
            f"{op}(quant_mode={quant_mode}) is not emulated: only quant_mode=-1 (no quantisation) has CPU semantics "
            "here (note: the schema default is 0 = static quantisation)")
    if drop_pad_mode != 0:
        raise NotEmulatedError(f"{op}(drop_pad_mode={drop_pad_mode}) (drop/pad mode) is not emulated")
    if offset is not None:
        raise RuntimeError(f"{op}: offset must be None when quant_mode is -1")
    if x.dim() != 2:
        raise RuntimeError(f"{op}: The x should be 2-Dimension, current is {x.dim()}-Dimension.")
    if expert_idx.dim() != 2:
        raise RuntimeError(f"{op}: The expert_idx should be 2-Dimension, current is {expert_idx.dim()}-Dimension.")
    if x.dtype not in _FLOAT_DTYPES:
        raise NotEmulatedError(f"{op} with x dtype {x.dtype} is not emulated (float16/bfloat16/float32 only)")
    if expert_idx.dtype != torch.int32:
        raise RuntimeError(f"{op}: expert_idx must be int32, got {expert_idx.dtype}")
    rows, hidden = int(x.size(0)), int(x.size(1))
    if int(expert_idx.size(0)) != rows:
        raise RuntimeError(f"{op}: expert_idx has {int(expert_idx.size(0))} rows but x has {rows}")
    k = int(expert_idx.size(1))
    rng = list(active_expert_range) if active_expert_range is not None else []
    if len(rng) == 0:
        if expert_num <= 0:
            raise RuntimeError(f"{op}: expert_num must be given (> 0) when active_expert_range is empty")
        rng = [0, int(expert_num)]
    if len(rng) != 2:
        raise RuntimeError(f"{op}: The active_expert_range should be 2-Dimension, current is {len(rng)}-Dimension.")
    start, end = int(rng[0]), int(rng[1])
    if not (0 <= start < end) or (expert_num > 0 and end > expert_num):
        raise RuntimeError(
            f"{op}: active_expert_range [{start}, {end}) must satisfy 0 <= start < end <= expert_num ({expert_num})")
    if expert_tokens_num_type not in (0, 1, 2):
        raise RuntimeError(f"{op}: expert_tokens_num_type must be 0, 1 or 2, got {expert_tokens_num_type}")
    if row_idx_type not in (0, 1):
        raise RuntimeError(f"{op}: row_idx_type must be 0 or 1, got {row_idx_type}")
    if expert_tokens_num_type == 2 and expert_num <= 0:
        raise RuntimeError(f"{op}: expert_num must be > 0 when expert_tokens_num_type is 2 (key_value)")
    if scale is not None and (scale.dim() != 1 or int(scale.size(0)) != rows):
        raise RuntimeError(f"{op}: in non-quantisation scenarios scale must be 1-D (NUM_ROWS,), got {tuple(scale.shape)}")

    total = rows * k
    flat = expert_idx.reshape(-1).long()
    n_valid = int(((flat >= start) & (flat < end)).sum())
    keyed = torch.where(flat < start, torch.full_like(flat, _INT32_MAX), flat)
    order = torch.sort(keyed, stable=True).indices
    sorted_ids = keyed[order]

    if row_idx_type == 1:  # scatter indices; entries past n_valid are uninitialised (OPD-mir2 return values)
        expanded_row_idx = torch.full((total,), _INT32_POISON, dtype=torch.int32)
        expanded_row_idx[:n_valid] = order[:n_valid].to(torch.int32)
    else:  # gather indices, -1 for slots outside the active range
        expanded_row_idx = torch.full((total,), -1, dtype=torch.int32)
        expanded_row_idx[order[:n_valid]] = torch.arange(n_valid, dtype=torch.int32)

    n_experts_range = end - start
    counts = torch.bincount(sorted_ids[:n_valid] - start, minlength=n_experts_range)[:n_experts_range]
    if expert_tokens_num_type == 2:
        tokens_shape: tuple[int, ...] = (int(expert_num), 2)
    else:
        tokens_shape = (n_experts_range,)
    if not expert_tokens_num_flag:
        expert_tokens = torch.full(tokens_shape, _INT64_POISON, dtype=torch.int64)
    elif expert_tokens_num_type == 0:
        expert_tokens = torch.cumsum(counts, dim=0).to(torch.int64)
    elif expert_tokens_num_type == 1:
        expert_tokens = counts.to(torch.int64)
    else:  # key_value: [expert_id, count] pairs of experts with tokens, first; then one [0, 0] row (doc code)
        expert_tokens = torch.full(tokens_shape, _INT64_POISON, dtype=torch.int64)
        present = torch.nonzero(counts > 0).reshape(-1)
        n_pairs = int(present.numel())
        expert_tokens[:n_pairs, 0] = present + start
        expert_tokens[:n_pairs, 1] = counts[present]
        if n_pairs < int(expert_num):
            expert_tokens[n_pairs] = 0

    n_rows_out = min(total, int(active_num)) if active_num > 0 else total
    n_fill = n_valid if active_num <= 0 else min(int(active_num), n_valid)
    expanded_x = _poison_like_float((n_rows_out, hidden), x.dtype)
    expanded_x[:n_fill] = x[order[:n_fill] // k]
    expanded_scale = _poison_like_float((n_rows_out,), torch.float32)
    if scale is not None:
        expanded_scale[:n_fill] = scale.float()[order[:n_fill] // k]
    return expanded_x, expanded_row_idx, expert_tokens, expanded_scale


def npu_moe_init_routing_v2(
    x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None, active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
    drop_pad_mode: int = 0, expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
    quant_mode: int = 0, active_expert_range: Sequence[int] | None = (), row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing v2 (dropless, no quantisation): sort the (token, k) slots by expert within an active range.

    Flatten ``expert_idx (R, K)`` row-major (slot ``j = r * K + k``); ``[start, end) = active_expert_range``
    (default ``[0, expert_num)``). Ids ``< start`` become INT32_MAX; ``order`` = stable argsort of the ids; the first
    ``n_valid = #{start <= id < end}`` entries of ``order`` are the valid slots (ids ``>= end`` sort after them).

    * ``expanded_x[i] = x[order[i] // K]`` for ``i < min(active_num, n_valid)`` (``active_num`` <= 0: ``n_valid``);
      shape ``(min(active_num, R*K), H)`` if ``active_num > 0`` else ``(R*K, H)``; the remaining rows are
      uninitialised on the device (NaN here).
    * ``row_idx_type=0`` (gather): ``expanded_row_idx[order[i]] = i`` for valid slots, **-1** for the others.
      ``row_idx_type=1`` (scatter): ``expanded_row_idx[i] = order[i]`` for ``i < n_valid``, uninitialised after
      (INT32_MIN here).
    * ``expert_tokens_num_flag=True``: ``expert_tokens_num_type`` 0 = cumsum of the per-expert counts, 1 = counts,
      both ``(end - start,)`` int64; 2 = ``(expert_num, 2)`` ``[expert_id, count]`` rows for the experts with tokens,
      then one ``[0, 0]`` row (the rest uninitialised). With the flag False the tensor is uninitialised (INT64_MIN).
    * ``expanded_scale`` (float32, one entry per ``expanded_x`` row): ``scale[order[i] // K]`` when ``scale`` is given,
      otherwise meaningless (NaN).

    Args:
        x: ``(R, H)`` float16/bfloat16/float32.
        expert_idx: ``(R, K)`` int32.
        scale: ``None`` or ``(R,)`` float32.
        offset: must be ``None``.
        active_num, expert_num, expert_tokens_num_type, expert_tokens_num_flag, active_expert_range,
        row_idx_type: as above. ``expert_capacity`` is only used by drop/pad mode.
        drop_pad_mode: must be 0.
        quant_mode: must be -1. **The default is 0** (static quantisation) in the torch_npu 7.2.0/7.3.0 schema
            (OPY72), which vllm-ascend 0.11-0.15 pins; vllm-ascend always passes it.

    Returns:
        ``(expanded_x, expanded_row_idx (R*K,) int32, expert_token_cumsum_or_count int64, expanded_scale float32)``.

    Raises:
        NotEmulatedError: ``quant_mode != -1``, ``drop_pad_mode != 0``, int8 ``x``.
        RuntimeError: wrong ranks/dtypes, a bad ``active_expert_range``, ``expert_num`` missing.

    Source: OPD-mir2 (formulas, equivalent code, return values); OPY72 schema; OPMETA; docs/operators.md §4.3.
    """
    return _init_routing_v2("npu_moe_init_routing_v2", x, expert_idx, scale, offset, active_num, expert_capacity,
                            expert_num, drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag, quant_mode,
                            active_expert_range, row_idx_type)


def c_ascend_npu_moe_init_routing_custom(
    x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None, active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
    drop_pad_mode: int = 0, expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
    quant_mode: int = 0, active_expert_range: Sequence[int] | None = (), row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU kernel of ``torch.ops._C_ascend.npu_moe_init_routing_custom`` (vllm-ascend >= 0.13 custom op).

    Same semantics, arguments, returns and errors as :func:`npu_moe_init_routing_v2` (its schema is a copy of v2's,
    including ``quant_mode=0`` as the default). Source: VA@v0.13.0 csrc/torch_binding.cpp (schema),
    csrc/torch_binding_meta.cpp ``npu_moe_init_routing_custom_meta`` (shapes), VA@v0.13.0
    ops/fused_moe/token_dispatcher.py (call site); docs/operators.md §4.3.
    """
    return _init_routing_v2("npu_moe_init_routing_custom", x, expert_idx, scale, offset, active_num, expert_capacity,
                            expert_num, drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag, quant_mode,
                            active_expert_range, row_idx_type)


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: torch.Tensor, num_expert: int) -> torch.Tensor:
    """For each expert ``i``, the end offset of its rows in a sorted expert list (a cumulative ``group_list``).

    ``expert_tokens[i] = #{j : sorted[j] <= i}`` (binary search for the last row of expert ``i``; experts without
    rows repeat the previous offset), which vllm-ascend's torchair path feeds to ``npu_grouped_matmul`` with
    ``group_list_type=0``.

    Args:
        sorted_expert_for_source_row: 1-D int32, non-decreasing, values in ``[0, num_expert)``, fewer than 2**24.
        num_expert: ``0 < num_expert <= 2048``.

    Returns:
        ``(num_expert,)`` tensor of the input's dtype.

    Raises:
        RuntimeError: rank/dtype/range violations, unsorted input (simulator guard; the kernel assumes it).

    Source: op-plugin docs ``torch_npu-npu_moe_compute_expert_tokens.md`` (BinarySearch formula, limits);
    OPY72 schema; VA@v0.11.0 torchair/ops/torchair_fused_moe.py (call site, ``group_list_type=0``). Not called by
    vllm-ascend 0.11.0's eager unquantised path (ops/moe/), only by its torchair path.
    """
    op = "npu_moe_compute_expert_tokens"
    s = sorted_expert_for_source_row
    if s.dim() != 1 or s.dtype != torch.int32:
        raise RuntimeError(f"{op}: sorted_expert_for_source_row must be a 1-D int32 tensor, got {s.dim()}-D {s.dtype}")
    if s.numel() >= 2 ** 24:
        raise RuntimeError(f"{op}: the number of elements must be less than 2**24")
    if not 0 < num_expert <= 2048:
        raise RuntimeError(f"{op}: num_expert must be in (0, 2048], got {num_expert}")
    if s.numel():
        if int(s.min()) < 0 or int(s.max()) >= num_expert:
            raise RuntimeError(f"{op}: values must be in [0, {num_expert - 1}]")
        if bool((s[1:] < s[:-1]).any()):
            raise RuntimeError(f"{op}: sorted_expert_for_source_row must be non-decreasing")
    return torch.searchsorted(s.long(), torch.arange(num_expert), right=True).to(s.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# combine (docs/operators.md §4.3)
# ---------------------------------------------------------------------------------------------------------------------


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None, skip2: torch.Tensor | None,
    bias: torch.Tensor | None, scales: torch.Tensor | None, expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None, drop_pad_mode: int | None = 0,
) -> torch.Tensor:
    """Combine expert outputs: ``out[i] = skip1[i] + skip2[i] + sum_k scales[i,k] * (rows[idx(i,k)] + bias[e(i,k)])``.

    ``idx(i, k) = expanded_src_to_dst_row[k * R + i]`` (column-major) for ``drop_pad_mode`` 0/1 and
    ``[i * K + k]`` (row-major) for 2/3; an index of -1 contributes a zero row (bias still added, as the doc code
    does); ``e(i, k) = export_for_source_row[i, k]``. Missing ``skip1``/``skip2``/``bias`` are dropped, missing
    ``scales`` means ``K = 1`` and weight 1. Computed in float32.

    Args:
        expanded_permuted_rows: ``(R*K, H)`` (modes 0/2) or ``(E, C, H)`` (modes 1/3), float16/bfloat16/float32.
        skip1, skip2: ``None`` or ``(R, H)`` of the same dtype; ``skip2`` requires ``skip1``.
        bias: ``None`` or ``(E, H)``.
        scales: ``None`` or ``(R, K)``.
        expanded_src_to_dst_row: ``(R*K,)`` int32.
        export_for_source_row: ``(R, K)`` int32 expert ids (required when ``bias`` is given).
        drop_pad_mode: 0..3.

    Returns:
        ``(R, H)`` tensor of ``expanded_permuted_rows``' dtype.

    Raises:
        RuntimeError: shape/dtype/index violations.

    Source: OPD-mfr (formula, equivalent code, parameter table); OPY72 schema; docs/operators.md §4.3.
    """
    op = "npu_moe_finalize_routing"
    mode = 0 if drop_pad_mode is None else int(drop_pad_mode)
    if mode not in (0, 1, 2, 3):
        raise RuntimeError(f"{op}: drop_pad_mode must be 0, 1, 2 or 3, got {mode}")
    rows_in = expanded_permuted_rows
    if rows_in.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(f"{op}: expanded_permuted_rows dtype must be float16, bfloat16 or float32")
    if rows_in.dim() != (2 if mode in (0, 2) else 3):
        raise RuntimeError(f"{op}: expanded_permuted_rows must be {'2' if mode in (0, 2) else '3'}-D for drop_pad_mode {mode}")
    hidden = int(rows_in.size(-1))
    rows2 = rows_in.reshape(-1, hidden).float()
    if skip1 is None and skip2 is not None:
        raise RuntimeError(f"{op}: When skip1 is None, skip2 must also be None")
    src = expanded_src_to_dst_row
    if src.dim() != 1 or src.dtype != torch.int32:
        raise RuntimeError(f"{op}: expanded_src_to_dst_row must be a 1-D int32 tensor")
    k = int(scales.size(1)) if scales is not None else 1
    nk = int(src.numel())
    if nk % k:
        raise RuntimeError(f"{op}: expanded_src_to_dst_row has {nk} elements, not a multiple of K={k}")
    num_rows = nk // k
    if bias is not None and export_for_source_row is None:
        raise RuntimeError(f"{op}: export_for_source_row is required when bias is given")
    out = torch.zeros(num_rows, hidden, dtype=torch.float32)
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            if tuple(skip.shape) != (num_rows, hidden) or skip.dtype != rows_in.dtype:
                raise RuntimeError(f"{op}: {name} must be ({num_rows}, {hidden}) of dtype {rows_in.dtype}")
            out += skip.float()
    src_l = src.long()
    if mode in (0, 1):
        idx = src_l.reshape(k, num_rows).t()
    else:
        idx = src_l.reshape(num_rows, k)
    if bool(((idx < -1) | (idx >= rows2.size(0))).any()):
        raise RuntimeError(f"{op}: expanded_src_to_dst_row values must be -1 or in [0, {rows2.size(0) - 1}]")
    gathered = torch.where((idx >= 0).unsqueeze(-1), rows2[idx.clamp(min=0)], torch.zeros((), dtype=torch.float32))
    if bias is not None:
        gathered = gathered + bias.float()[export_for_source_row.long()]
    weights = scales.float() if scales is not None else torch.ones(num_rows, 1)
    out += (weights.unsqueeze(-1) * gathered).sum(dim=1)
    return out.to(rows_in.dtype)


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the tokens by expert: ``permuted[i] = tokens[first[i] // K]``, ``first = stable_argsort(indices.flatten())``.

    The second output is the inverse permutation ``sorted_indices = argsort(first)`` - for each flattened (token, k)
    slot, the row of ``permuted`` it went to ("the fusion operator performs two argsorts",
    OPT-test_npu_moe_token_permute_and_unpermute.py). Output rows: ``num_out_tokens`` if > 0 (capped at ``R*K``),
    else ``R*K + num_out_tokens`` (OPSZ ``npu_moe_token_permute_out_size``).
    Padded mode: ``permuted = tokens[indices.flatten()]``, ``sorted_indices = indices``.

    Args:
        tokens: ``(R, H)``.
        indices: ``(R,)`` or ``(R, K)`` integer expert ids (padded mode: ``(E, capacity)`` token ids).
        num_out_tokens: see above (``None`` = 0).
        padded_mode: see above.

    Returns:
        ``(permuted_tokens (n_out, H) tokens.dtype, sorted_indices (R*K,) int32)``.

    Raises:
        RuntimeError: ``tokens`` not 2-D, ``indices`` not 1-D/2-D (OPSZ checks).

    Source: OPY72 schema; OPSZ; OTX-moe moe_token_permute README; OPT golden; docs/operators.md §4.3.
    """
    op = "npu_moe_token_permute"
    if tokens.dim() != 2:
        raise RuntimeError(f"{op}: The dims of input tokens should be 2 dimensional, but got {tokens.dim()}-dimensional.")
    if indices.dim() not in (1, 2):
        raise RuntimeError(f"{op}: The dims of input indices should be 2 or 1 dimensional, but got {indices.dim()}-dimensional.")
    if padded_mode:
        return tokens.index_select(0, indices.reshape(-1).long()), indices.clone()
    k = 1 if indices.dim() == 1 else int(indices.size(1))
    flat = indices.reshape(-1).long()
    total = int(flat.numel())
    n_req = 0 if num_out_tokens is None else int(num_out_tokens)
    n_out = min(n_req, total) if n_req > 0 else total + n_req
    if n_out < 0:
        raise RuntimeError(f"{op}: num_out_tokens={num_out_tokens} gives a negative number of output rows")
    first = torch.sort(flat, stable=True).indices
    permuted = tokens.index_select(0, first[:n_out] // k)
    sorted_indices = torch.sort(first, stable=True).indices.to(torch.int32)
    return permuted, sorted_indices


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None = None,
    padded_mode: bool = False, restore_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Gather the expert rows back per token: ``out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]``.

    Without ``probs``: ``K = 1`` and ``out[t] = permuted[sorted_indices[t]]``. Output ``(sorted_indices.numel() // K,
    H)`` (OPSZ ``npu_moe_token_unpermute_out_size``), computed in float32, returned in ``permuted_tokens``' dtype.
    Padded mode: ``out = zeros(restore_shape)``, ``out[sorted_indices.flatten()[i]] += probs.flatten()[i] * permuted[i]``.

    Note: with vllm-ascend's AllGather dispatcher (``sorted_indices = abs(expanded_row_idx)``) the slots outside the
    local expert range point at row 1 with probability 0; ``0 * NaN`` is NaN, so if that row is uninitialised GMM
    output (rank with <= 1 routed slot) the result is NaN here - on the device it is whatever garbage was there.

    Args:
        permuted_tokens: ``(N, H)``.
        sorted_indices: ``(R*K,)`` integer, values in ``[0, N)``.
        probs: ``None`` or ``(R, K)`` floating.
        padded_mode, restore_shape: see above.

    Returns:
        ``(R, H)`` (or ``restore_shape``) tensor of ``permuted_tokens``' dtype.

    Raises:
        RuntimeError: rank checks of OPSZ, ``K`` not dividing ``sorted_indices.numel()``, missing ``restore_shape``
            in padded mode.
        NotEmulatedError: an index outside ``[0, N)`` (no documented semantics for dropped slots).

    Source: OPY72 schema; OPSZ; OTX-moe moe_token_unpermute README; OPT golden ``unpermute``; docs/operators.md §4.3.
    """
    op = "npu_moe_token_unpermute"
    if probs is not None and probs.dim() != 2:
        raise RuntimeError(f"{op}: The dims of input probs should be 2 dimensional, but got {probs.dim()}-dimensional.")
    if permuted_tokens.dim() != 2:
        raise RuntimeError(
            f"{op}: The dims of input permuted_tokens should be 2 dimensional, but got {permuted_tokens.dim()}-dimensional.")
    hidden = int(permuted_tokens.size(1))
    rows = permuted_tokens.float()
    if padded_mode:
        if restore_shape is None:
            raise RuntimeError(f"{op}: restore_shape is required in padded mode")
        idx = sorted_indices.reshape(-1).long()
        w = probs.reshape(-1, 1).float() if probs is not None else torch.ones(idx.numel(), 1)
        out = torch.zeros(tuple(restore_shape), dtype=torch.float32)
        out.index_add_(0, idx, w * rows)
        return out.to(permuted_tokens.dtype)
    if sorted_indices.dim() != 1:
        raise RuntimeError(
            f"{op}: The dims of input sorted_indices should be 1 dimensional, but got {sorted_indices.dim()}-dimensional.")
    k = int(probs.size(1)) if probs is not None else 1
    if k <= 0:
        raise RuntimeError(f"{op}: The topk should be greater than zero in npu_moe_token_unpermute_out_size, but got {k}")
    n = int(sorted_indices.numel())
    if n % k:
        raise RuntimeError(f"{op}: sorted_indices has {n} elements, not a multiple of topk={k}")
    num_tokens = n // k
    if probs is not None and int(probs.size(0)) != num_tokens:
        raise RuntimeError(f"{op}: probs has {int(probs.size(0))} rows, expected {num_tokens}")
    idx = sorted_indices.long()
    if n and (int(idx.min()) < 0 or int(idx.max()) >= int(rows.size(0))):
        raise NotEmulatedError(
            f"torch_npu.{op} with sorted_indices outside [0, {int(rows.size(0))}) is not emulated "
            "(no documented semantics for dropped slots)")
    gathered = rows[idx].reshape(num_tokens, k, hidden)
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted_tokens.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# vllm-ascend's own compiled MoE ops under torch.ops._C_ascend
# ---------------------------------------------------------------------------------------------------------------------

#: Schemas of vllm-ascend 0.13.0 ``csrc/torch_binding.cpp`` (read from the 0.13.0 wheel's
#: ``vllm_ascend_C.cpython-311-x86_64-linux-gnu.so``; identical to the repository source).
C_ASCEND_SCHEMAS: dict[str, str] = {
    "moe_gating_top_k": (
        "moe_gating_top_k(Tensor x, int k, int k_group, int group_count, int group_select_mode, int renorm, "
        "int norm_type, bool out_flag, float routed_scaling_factor, float eps, Tensor? bias_opt=None) "
        "-> (Tensor y, Tensor expert_idx, Tensor out)"
    ),
    "npu_moe_init_routing_custom": (
        "npu_moe_init_routing_custom(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
        "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    # vllm-ascend csrc/torch_binding.cpp weak_ref_tensor: at::from_blob over the input's memory (no ownership).
    "weak_ref_tensor": "weak_ref_tensor(Tensor(a) input) -> Tensor(a)",
}


def c_ascend_weak_ref_tensor(input: torch.Tensor) -> torch.Tensor:
    """``torch.ops._C_ascend.weak_ref_tensor``: a tensor over the same memory as ``input`` (same shape/strides).

    The compiled op builds a non-owning view (``at::from_blob``), so graph-capture bookkeeping does not keep
    buffers alive. On the CPU a non-owning tensor could outlive its memory; the simulator returns an owning
    alias (``input.detach()``): identical values and addresses, only a longer lifetime (memory is freed later).
    Source: vllm-ascend ``csrc/torch_binding.cpp`` (``weak_ref_tensor``), ``vllm_ascend/utils.py`` ``weak_ref_tensor``.
    """
    return input.detach()


def _fake_moe_gating_top_k(x, k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                           routed_scaling_factor, eps, bias_opt=None):
    # csrc/torch_binding_meta.cpp moe_gating_top_k_meta
    rows, num_experts = x.shape[0], x.shape[1]
    return (x.new_empty((rows, k)), x.new_empty((rows, k), dtype=torch.int32),
            x.new_empty((rows, num_experts), dtype=torch.float32))


def _fake_init_routing_custom(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                              expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                              expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(), row_idx_type=0):
    # csrc/torch_binding_meta.cpp npu_moe_init_routing_custom_meta
    rng = list(active_expert_range) if active_expert_range else [0, expert_num]
    bs, h = x.shape[0], x.shape[1]
    k = expert_idx.shape[1]
    out_dtype = x.dtype if quant_mode == -1 else torch.int8
    if drop_pad_mode == 1:
        expanded_x = x.new_empty((expert_num, expert_capacity, h), dtype=out_dtype)
        scale_len = expert_num * expert_capacity
    else:
        n_out = min(bs * k, active_num) if active_num > 0 else bs * k
        expanded_x = x.new_empty((n_out, h), dtype=out_dtype)
        scale_len = n_out
    tokens_shape = (expert_num, 2) if expert_tokens_num_type == 2 else (rng[1] - rng[0],)
    return (expanded_x, expert_idx.new_empty((bs * k,)), x.new_empty(tokens_shape, dtype=torch.int64),
            x.new_empty((scale_len,), dtype=torch.float32))


_C_ASCEND_IMPLS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "moe_gating_top_k": (c_ascend_moe_gating_top_k, _fake_moe_gating_top_k),
    "npu_moe_init_routing_custom": (c_ascend_npu_moe_init_routing_custom, _fake_init_routing_custom),
    "weak_ref_tensor": (c_ascend_weak_ref_tensor, lambda input: input.detach()),
}

_C_ASCEND_LIB: torch.library.Library | None = None  # kept alive: a Library deregisters its ops when collected
_C_ASCEND_LOCK = threading.Lock()


def _op_defined(qualname: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return True


def register_c_ascend_ops() -> list[str]:
    """Define vllm-ascend's compiled MoE ops under ``torch.ops._C_ascend`` with CPU and fake kernels; idempotent.

    Registers ``moe_gating_top_k`` (:func:`c_ascend_moe_gating_top_k`) and ``npu_moe_init_routing_custom``
    (:func:`c_ascend_npu_moe_init_routing_custom`) with the schemas in :data:`C_ASCEND_SCHEMAS`. An op whose schema
    is already defined (by an earlier call, or by the real vllm-ascend library) is left alone.

    Returns:
        The names registered by this call (empty when everything was already there).

    Raises:
        RuntimeError: torch.library rejects a registration.

    Source: VA@v0.13.0 csrc/torch_binding.cpp / torch_binding_meta.cpp; docs/operators.md §4.3, §4.4.
    """
    global _C_ASCEND_LIB
    done: list[str] = []
    with _C_ASCEND_LOCK:
        for name, schema in C_ASCEND_SCHEMAS.items():
            qualname = f"_C_ascend::{name}"
            if _op_defined(qualname):
                continue
            if _C_ASCEND_LIB is None:
                _C_ASCEND_LIB = torch.library.Library("_C_ascend", "FRAGMENT")
            impl, fake = _C_ASCEND_IMPLS[name]
            _C_ASCEND_LIB.define(schema)
            _C_ASCEND_LIB.impl(name, impl, "CPU")
            torch.library.register_fake(qualname, fake, lib=_C_ASCEND_LIB)
            done.append(name)
    return done


#: Emulated torch_npu operators of this family.
OPS: dict[str, Callable[..., Any]] = {
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_swiglu": npu_swiglu,
    "npu_moe_gating_top_k_softmax": npu_moe_gating_top_k_softmax,
    "npu_moe_gating_top_k": npu_moe_gating_top_k,
    "npu_moe_init_routing": npu_moe_init_routing,
    "npu_moe_init_routing_v2": npu_moe_init_routing_v2,
    "npu_moe_compute_expert_tokens": npu_moe_compute_expert_tokens,
    "npu_moe_finalize_routing": npu_moe_finalize_routing,
    "npu_moe_token_permute": npu_moe_token_permute,
    "npu_moe_token_unpermute": npu_moe_token_unpermute,
    "npu_format_cast": npu_format_cast,
    "npu_format_cast_": npu_format_cast_,
    "get_npu_format": get_npu_format,
}
