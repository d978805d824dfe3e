"""MXFP4 expert tensors of the official GPT-OSS checkpoints: dequantization to BF16, the writer's quantizer, and a
lazily dequantizing tensor that vLLM's BF16 GPT-OSS loader slices per rank.

Format (OCP Microscaling Formats v1.0 MXFP4, as the official ``openai/gpt-oss-*`` checkpoints store it and as
transformers 4.57 ``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` reads it):

* ``*_blocks`` uint8 ``[E, R, G, 16]``: 32 FP4 E2M1 codes per block, two per byte, the *low* nibble is the even
  element (``out[..., 0::2] = lut[b & 0x0F]``, ``out[..., 1::2] = lut[b >> 4]``); code ``c`` means
  :data:`FP4_VALUES` ``[c]`` (bit 3 = sign, then 2 exponent bits and 1 mantissa bit);
* ``*_scales`` uint8 ``[E, R, G]``: E8M0, one per block, the block's factor is ``2 ** (scale - 127)``;
* dequantized ``[E, R, G * 32]`` (*block layout*); the BF16 checkpoint tensor is its transpose ``[E, G * 32, R]``
  (transformers returns ``out.transpose(1, 2)``): ``gate_up_proj_blocks [E, 2I, H/32, 16]`` -> ``gate_up_proj
  [E, H, 2I]`` and ``down_proj_blocks [E, H, I/32, 16]`` -> ``down_proj [E, I, H]``, the layout of the BF16 releases
  (``unsloth/gpt-oss-*-BF16``) that vLLM's ``GptOssModel._load_weights_other`` reads.

Bit-exactness: :func:`dequantize` computes each element with the same operations as transformers
(``lut[code]`` in the target dtype, then ``torch.ldexp(value, scale - 127)`` in place), so any region, chunking or
element order gives the same bits (the operations are elementwise).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

#: FP4 E2M1 code -> value (OCP MX v1.0 §5.3.3; transformers ``integrations/mxfp4.py`` ``FP4_VALUES``).
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  #: elements per MXFP4 block (one E8M0 scale each)
SCALE_BIAS = 127  #: E8M0 exponent bias

__all__ = ["FP4_VALUES", "BLOCK", "Mxfp4ShapeError", "expected_shapes", "check_pair", "dequantize",
           "dequantize_region", "quantize", "LazyMxfp4"]


class Mxfp4ShapeError(ValueError):
    """An MXFP4 ``*_blocks`` / ``*_scales`` tensor does not have the shape (or dtype) the model config implies."""


def expected_shapes(kind: str, num_experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's MXFP4 expert tensors in the official layout.

    Args:
        kind: ``"gate_up_proj"`` or ``"down_proj"``.
        num_experts, hidden, intermediate: ``num_local_experts``, ``hidden_size``, ``intermediate_size`` of the
            config (the packed dimension - ``hidden`` for gate_up, ``intermediate`` for down - must be a multiple of
            32).

    Returns:
        ``{"blocks": (E, R, G, 16), "scales": (E, R, G), "bf16": (E, C, R)}`` with ``C = G * 32``.

    Raises:
        ValueError: unknown ``kind`` or a packed dimension that is not a multiple of 32.
    """
    if kind == "gate_up_proj":
        rows, cols = 2 * intermediate, hidden
    elif kind == "down_proj":
        rows, cols = hidden, intermediate
    else:
        raise ValueError(f"unknown MXFP4 expert tensor {kind!r}; expected gate_up_proj or down_proj")
    if cols % BLOCK:
        raise ValueError(f"{kind}: packed dimension {cols} is not a multiple of the MXFP4 block size {BLOCK}")
    groups = cols // BLOCK
    return {"blocks": (num_experts, rows, groups, BLOCK // 2), "scales": (num_experts, rows, groups),
            "bf16": (num_experts, cols, rows)}


def check_pair(name: str, blocks: torch.Tensor, scales: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`Mxfp4ShapeError` naming ``name`` unless ``blocks``/``scales`` are uint8 of ``shapes``
    (from :func:`expected_shapes`)."""
    for what, tensor in (("blocks", blocks), ("scales", scales)):
        if tuple(tensor.shape) != shapes[what] or tensor.dtype != torch.uint8:
            raise Mxfp4ShapeError(f"MXFP4 tensor {name}_{what}: shape {list(tensor.shape)} dtype "
                                  f"{str(tensor.dtype).replace('torch.', '')}, expected shape {list(shapes[what])} "
                                  f"uint8 (from config.json: experts, rows, hidden/32 blocks"
                                  f"{', 16 bytes' if what == 'blocks' else ''})")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    """MXFP4 -> ``dtype`` in block layout.

    Args:
        blocks: uint8 ``[..., G, 16]``.
        scales: uint8 ``[..., G]`` (same leading shape).
        dtype: output dtype (bfloat16 as transformers' default).
        rows_per_chunk: blocks converted per step (bounds the int64 index scratch: 256 bytes per block).

    Returns:
        ``[..., G * 32]`` contiguous ``dtype``: element ``2k`` / ``2k+1`` of block ``g`` is
        ``FP4_VALUES[b & 0xF]`` / ``FP4_VALUES[b >> 4]`` of byte ``k``, times ``2 ** (scale - 127)`` through
        ``torch.ldexp`` - transformers 4.57 ``convert_moe_packed_tensors`` without its final transpose.

    Raises:
        Mxfp4ShapeError: ``blocks.shape[:-1] != scales.shape`` or the last dimension of ``blocks`` is not 16.
    """
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise Mxfp4ShapeError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair: "
                              f"expected blocks [..., G, 16] with scales [..., G]")
    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    flat_b = blocks.reshape(rows, width)
    flat_s = scales.reshape(rows, 1)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(rows, width * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rows)
        blk = flat_b[r0:r1]
        exp = flat_s[r0:r1].to(torch.int32) - SCALE_BIAS
        sub = out[r0:r1]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.long)]
        sub[:, 1::2] = lut[(blk >> 4).to(torch.long)]
        torch.ldexp(sub, exp, out=sub)
    return out.view(*prefix, groups * width * 2)


def dequantize_region(blocks: torch.Tensor, scales: torch.Tensor, experts: tuple[int, int], rows: tuple[int, int],
                      cols: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize only ``[e0:e1, r0:r1, c0:c1]`` of the block-layout tensor ``[E, R, G * 32]``.

    Reads the blocks covering ``cols`` (a column range may start or end inside a 32-element block, e.g. a TP rank's
    360 of 2880 intermediate columns) and nothing else; one expert at a time, so scratch memory is one expert's slice.

    Args:
        blocks: uint8 ``[E, R, G, 16]``; scales: uint8 ``[E, R, G]``.
        experts, rows, cols: half-open ranges ``(start, stop)`` within ``E``, ``R`` and ``G * 32``.

    Returns:
        ``[e1 - e0, r1 - r0, c1 - c0]`` contiguous ``dtype``, equal bit for bit to
        ``dequantize(blocks, scales)[e0:e1, r0:r1, c0:c1]``.

    Raises:
        Mxfp4ShapeError: blocks and scales do not pair (see :func:`dequantize`); ValueError: a range outside the
        tensor.
    """
    (e0, e1), (r0, r1), (c0, c1) = experts, rows, cols
    E, R, G, _ = blocks.shape
    if not (0 <= e0 <= e1 <= E and 0 <= r0 <= r1 <= R and 0 <= c0 <= c1 <= G * BLOCK):
        raise ValueError(f"MXFP4 region experts {experts}, rows {rows}, cols {cols} is outside [{E}, {R}, {G * BLOCK}]")
    g0, g1 = c0 // BLOCK, -(-c1 // BLOCK)
    out = torch.empty(e1 - e0, r1 - r0, c1 - c0, dtype=dtype, device=blocks.device)
    for i, e in enumerate(range(e0, e1)):
        part = dequantize(blocks[e, r0:r1, g0:g1], scales[e, r0:r1, g0:g1], dtype)
        out[i].copy_(part[:, c0 - g0 * BLOCK: c1 - g0 * BLOCK])
    return out


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., C]`` (block layout, ``C`` a multiple of 32) to MXFP4 ``(blocks, scales)``.

    Per block of 32: scale exponent ``s = clamp(ceil(log2(amax / 6)), -127, 127)`` (the smallest power of two that
    brings the block's largest magnitude within FP4's ±6; stored ``s + 127``), each element the FP4 value nearest to
    ``x / 2**s`` (ties to the smaller magnitude), packed low nibble first. The writer of the tiny MXFP4 checkpoints
    (:mod:`gptoss_patch.selftest.tiny`); its output is checked against transformers' dequantizer in the tests.

    Returns:
        ``blocks`` uint8 ``[..., C/32, 16]`` and ``scales`` uint8 ``[..., C/32]``.

    Raises:
        ValueError: ``C`` is not a multiple of 32, or ``weight`` holds a non-finite value.
    """
    *prefix, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"last dimension {cols} is not a multiple of the MXFP4 block size {BLOCK}")
    w = weight.detach().to(torch.float32).reshape(*prefix, cols // BLOCK, BLOCK)
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize non-finite values to MXFP4")
    amax = w.abs().amax(dim=-1, keepdim=True)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -SCALE_BIAS))
    scaled = w / torch.exp2(exp)
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # first minimum: ties to smaller
    code = code + 8 * (scaled < 0).to(code.dtype) * (code > 0).to(code.dtype)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


_aten = torch.ops.aten


class LazyMxfp4(torch.Tensor):
    """The BF16 checkpoint tensor ``[E, C, R]`` of an MXFP4 pair, dequantized only where it is read.

    vLLM's BF16 GPT-OSS loader (``GptOssModel._load_weights_other``, vLLM 0.11.0 ... 0.19.1) takes each rank's
    slice itself (``weight[:, :, 2*s:2*e]`` / ``weight[:, s:e, :]`` for TP, ``weight[a:b, ...]`` for EP), then
    ``.permute(0, 2, 1).contiguous()`` and ``param.copy_(...)``. This tensor has no storage: slicing and permuting
    only narrow a view of the blocks; the first other operation (``copy_`` into the parameter, ``clone``, anything)
    dequantizes exactly the viewed region (:func:`dequantize_region`) and runs on that. So each rank dequantizes its
    own slice, with vLLM's own slicing rules, and never the whole tensor; a ``copy_`` into a tensor of this shape
    dequantizes one expert at a time straight into it (:meth:`copy_into`), so the slice is never held twice.

    Construct with :meth:`create`. ``dtype`` is bfloat16 (what transformers' dequantizer yields); device that of the
    blocks.
    """

    @staticmethod
    def __new__(cls, blocks, scales, dims, ranges):
        shape = [stop - start for start, stop in ranges]
        self = torch.Tensor._make_wrapper_subclass(cls, shape, strides=_contiguous_strides(shape),
                                                   dtype=torch.bfloat16, device=blocks.device, requires_grad=False)
        self._blocks, self._scales = blocks, scales
        self._dims = tuple(dims)  # logical dim -> source axis (0 = experts E, 1 = columns C, 2 = rows R)
        self._ranges = tuple(ranges)  # logical dim -> (start, stop) on its source axis
        return self

    def __init__(self, *args, **kwargs):  # torch.Tensor.__init__ must not see our arguments
        super().__init__()

    @classmethod
    def create(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "LazyMxfp4":
        """The lazy ``[E, G * 32, R]`` tensor of ``blocks [E, R, G, 16]`` / ``scales [E, R, G]``."""
        E, R, G, _ = blocks.shape
        return cls(blocks, scales, (0, 1, 2), ((0, E), (0, G * BLOCK), (0, R)))

    def __repr__(self, *, tensor_contents=None):
        return f"LazyMxfp4(shape={list(self.shape)}, dims={self._dims}, ranges={self._ranges})"

    def materialize(self) -> torch.Tensor:
        """The viewed region, dequantized: a bfloat16 tensor of this shape (a view of a contiguous block-layout
        region, permuted to this tensor's dimension order)."""
        by_axis = {axis: rng for axis, rng in zip(self._dims, self._ranges)}
        region = dequantize_region(self._blocks, self._scales, by_axis[0], by_axis[2], by_axis[1])  # [e, r, c]
        order = {0: 0, 2: 1, 1: 2}  # source axis -> position in the region
        return region.permute(*[order[a] for a in self._dims])

    def copy_into(self, dest: torch.Tensor) -> torch.Tensor:
        """``dest.copy_(self)`` one expert at a time: the viewed region is dequantized straight into ``dest`` (any
        layout, same shape), so no second copy of the rank's slice is ever held. Returns ``dest``."""
        if tuple(dest.shape) != tuple(self.shape):
            dest.copy_(self.materialize())  # broadcasting copy: torch's own rules and errors
            return dest
        e_dim = self._dims.index(0)
        lo, hi = self._ranges[e_dim]
        for i, e in enumerate(range(lo, hi)):
            ranges = list(self._ranges)
            ranges[e_dim] = (e, e + 1)
            part = LazyMxfp4(self._blocks, self._scales, self._dims, ranges).materialize()
            dest.narrow(e_dim, i, 1).copy_(part)
        return dest

    def _narrow(self, dim: int, start: int | None, end: int | None, step: int) -> "LazyMxfp4 | None":
        if step != 1:
            return None
        dim %= len(self._dims)
        lo, hi = self._ranges[dim]
        n = hi - lo
        s = 0 if start is None else (start + n if start < 0 else start)
        t = n if end is None else (end + n if end < 0 else end)
        s, t = max(0, min(s, n)), max(0, min(t, n))
        t = max(s, t)
        ranges = list(self._ranges)
        ranges[dim] = (lo + s, lo + t)
        return LazyMxfp4(self._blocks, self._scales, self._dims, ranges)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], LazyMxfp4):
            me = args[0]
            if func is _aten.slice.Tensor:
                dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
                dim = kwargs.get("dim", dim)
                lazy = me._narrow(dim, kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step))
                if lazy is not None:
                    return lazy
            elif func is _aten.narrow.default:
                dim, start, length = args[1:4]
                return me._narrow(dim, start, start + length, 1)
            elif func is _aten.permute.default:
                perm = [p % len(me._dims) for p in args[1]]
                return LazyMxfp4(me._blocks, me._scales, [me._dims[p] for p in perm], [me._ranges[p] for p in perm])
            elif func in (_aten.alias.default, _aten.detach.default):
                return LazyMxfp4(me._blocks, me._scales, me._dims, me._ranges)

        if (func is _aten.copy_.default and len(args) >= 2 and isinstance(args[1], LazyMxfp4)
                and not isinstance(args[0], LazyMxfp4) and not kwargs.get("non_blocking", False)):
            return args[1].copy_into(args[0])

        def real(x):
            return x.materialize() if isinstance(x, LazyMxfp4) else x

        args = tuple(real(a) for a in args)
        kwargs = {k: real(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
