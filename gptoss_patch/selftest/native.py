"""Harness of the native calibration cells: vllm-ascend with native GPT-OSS (0.15.0rc1, 0.16.0rc1, 0.17.0rc1, 0.18.0,
0.19.1rc1, each with its paired vLLM 0.15.0 / 0.16.0 / 0.17.0 / 0.18.0 / 0.19.1) on the simulator.

vllm-ascend >= 0.15.0rc1 runs GPT-OSS without our attention patches and was validated on hardware (commit
7221045777, PR #5901; ``docs/upstream.md`` §3). Running *its* code on the CPU NPU simulator and
comparing with Hugging Face transformers calibrates the simulator and shows what each release computes. This module
builds what that needs, the way vLLM and vllm-ascend do at run time. It branches on what the installed code has
(``hasattr`` on vLLM's ``ForwardContext``), never on version strings (:func:`installed_release` names the release
in messages):

* :func:`vllm_context` - a real ``VllmConfig`` for a tiny GPT-OSS checkpoint and the worker-side start-up of
  ``vllm_ascend/worker/worker.py`` (``NPUWorker.__init__`` and ``_init_worker_distributed_environment``),
  once per process.
* :func:`build_case` - one attention batch: paged KV cache, new q/k/v, and the :class:`AscendMetadata` made
  by the release's own ``AscendAttentionMetadataBuilder.build`` from an ``AscendCommonAttentionMetadata`` (the
  builder makes its own masks: ``attn_mask`` = 2048² int8 causal template and, up to 0.18.0, ``swa_mask`` = 2048²
  bool band, ``attention/attention_mask.py``; 0.19.1rc1 has no ``swa_mask``, PR #8387). The attention state follows
  ``NPUModelRunner._build_attn_state`` (the same rule, without speculative decoding, in every native release).
  KV block 0 is kept as vLLM's null block (all zeros, never assigned), so tests can apply block tables from vLLM's
  ``SlidingWindowManager``.
* :func:`make_impl`, :func:`run_native_forward` - the release's ``AscendAttentionBackendImpl`` built with the
  arguments vLLM's ``Attention.__init__`` passes (``sinks=`` as an extra impl argument), and its eager
  ``forward`` inside ``set_ascend_forward_context``.
* :func:`load_native_model` - the whole tiny model through vLLM's model loader (``get_model``), so the MoE
  layer is vLLM's ``MLPBlock`` whose ``FusedMoE`` was swapped for ``AscendFusedMoE`` by
  ``register_ascend_customop`` and whose weights came through ``GptOssModel._load_weights_other``.

The transformers references are :func:`gptoss_patch.selftest.attention.reference_output` (attention)
and :func:`load_reference_model` (``GptOssForCausalLM.from_pretrained`` on the same checkpoint; MoE).

What cannot run here, and why (each checked by :func:`vllm_context`):

* ``adapt_patch()`` (the worker patches): the worker patch modules whose import chain reaches ``torchvision`` (vLLM's
  multimodal model / processor modules) are skipped - no torchvision imports beside the cell's CPU torch 2.13 - and
  every other one is applied (:func:`expected_worker_patches`, asserted by :func:`vllm_context`); the skipped ones
  patch vision models, none is on GPT-OSS's path.
* ``_register_atb_extensions()`` loads vllm-ascend's compiled ATB library; the simulator provides the
  operators instead.
* ``NPUModelRunner`` is not built (its module imports ``numba``); of its ``__init__`` only
  ``set_weight_prefetch_method(ascend_config.weight_prefetch_config)`` is replayed, which the MoE path reads.
"""

from __future__ import annotations

import inspect
import os
import threading
import types
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gptoss_patch.selftest import worker as vllm_setup
from gptoss_patch.selftest.attention import NPU, Case, attn_state_for

_WP = "vllm_ascend.patch.worker."


def expected_worker_patches() -> tuple[set[str], list[str]]:
    """``(modules, skipped)``: the worker patch modules ``vllm_ascend/patch/worker/__init__.py`` imports outside the
    statements the simulator skipped because their imports need ``torchvision`` (the vision-model patches, e.g.
    ``patch_huanyuan_vl``; :func:`gptoss_patch_testkit.npu_sim.torch_compat.install_worker_patch_tolerance`), and those
    skipped statements."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm_ascend.patch.worker")
    skipped = vllm_setup.worker_patch_report()["skipped"]
    names: set[str] = set()
    with open(spec.origin, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), spec.origin)
    for node in tree.body:
        if ast.unparse(node) in skipped:
            continue
        # top-level imports only: those under a condition (``if HAS_TRITON:``) may rightly not run here
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith(_WP)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(_WP):
            names.add(node.module)
    return names, skipped


def installed_release() -> str:
    """The installed vllm-ascend's public version (``importlib.metadata``; local label dropped), e.g.
    ``"0.18.0"``: the key of the per-release tables of this module."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("vllm-ascend")).public


BLOCK_SIZE = 128  # AscendAttentionBackend.get_supported_kernel_block_sizes() in 0.15.0rc1 ... 0.19.1rc1
NULL_BLOCK = 0  # vllm/v1/core/block_pool.py: BlockPool.null_block is block 0

_lock = threading.Lock()
_context: dict[str, Any] = {}


def vllm_context(ckpt_dir: str | None = None, dtype: str = "float32"):
    """The process-wide ``VllmConfig`` of the calibration cell, with vllm-ascend's worker start-up done.

    Args:
        ckpt_dir: a tiny GPT-OSS checkpoint (:func:`gptoss_patch.selftest.tiny.write_checkpoint`); written to a
            temporary directory when None.
        dtype: model dtype of the engine config (``"float32"`` so that MoE weights and activations can be
            compared with transformers at float32 precision; attention inputs carry their own dtype).

    Returns:
        ``(vllm_config, ckpt_dir)``. The first call takes ~25 s (vLLM inspects the model class in a child
        interpreter); later calls return the same objects (one distributed world per process). A second call
        with a different ``dtype`` raises ``RuntimeError``.

    Raises:
        RuntimeError: a worker patch of :func:`expected_worker_patches` was not applied, or ``adapt_patch`` failed.

    Sources: vllm_ascend 0.15.0rc1 ... 0.19.1rc1 ``worker/worker.py`` (``NPUWorker.__init__``: ``adapt_patch``,
    ``ops.register_dummy_fusion_op``, ``register_ascend_customop``, ``init_ascend_config``,
    ``check_ascend_device_type``; ``_init_worker_distributed_environment``: ``init_distributed_environment``,
    ``ensure_model_parallel_initialized(tp, pp, pcp, dcp)``, ``init_ascend_model_parallel``; the ATB library load,
    :func:`gptoss_patch.selftest.worker.register_atb_extensions`).
    """
    with _lock:
        if _context:
            if _context["dtype"] != dtype:
                raise RuntimeError(f"the cell's vLLM context was created with dtype {_context['dtype']}, not {dtype}")
            return _context["config"], _context["ckpt"]
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from gptoss_patch.selftest import device

        device.torch_npu()  # the torch_npu present serves (real, or the testkit's simulator); ImportError with a hint
        if ckpt_dir is None:
            from gptoss_patch.selftest.tiny import write_checkpoint

            ckpt_dir = vllm_setup.process_scratch("gptoss-015-ckpt-")
            write_checkpoint(ckpt_dir, preset="tiny", seed=0, tokenizer=False)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.engine.arg_utils import EngineArgs

        cfg = EngineArgs(model=ckpt_dir, dtype=dtype, enforce_eager=True, max_model_len=1024,
                         skip_tokenizer_init=True, block_size=BLOCK_SIZE).create_engine_config()
        with set_current_vllm_config(cfg):
            rendezvous = vllm_setup.process_scratch("gptoss-015-", directory=False)
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         backend=device.distributed_backend(),
                                         distributed_init_method=f"file://{rendezvous}")
            ensure_model_parallel_initialized(1, 1, 1, 1)
            from vllm_ascend import ops
            from vllm_ascend.ascend_config import init_ascend_config
            from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel
            from vllm_ascend.utils import adapt_patch, check_ascend_device_type, register_ascend_customop

            init_ascend_model_parallel(cfg.parallel_config)
            try:
                adapt_patch()
            except Exception as exc:
                raise RuntimeError(f"vllm-ascend adapt_patch() failed: {exc}") from exc
            import sys

            expected, _skipped = expected_worker_patches()
            missing = sorted(expected - {m for m in sys.modules if m.startswith(_WP)})
            if missing:
                raise RuntimeError(f"worker patches not applied: {missing}")
            ops.register_dummy_fusion_op()
            vllm_setup.register_atb_extensions()
            register_ascend_customop(cfg)
            init_ascend_config(cfg)
            check_ascend_device_type()
            # NPUModelRunner.__init__ (worker/model_runner_v1.py): the one piece of model-runner state that the
            # eager MoE path reads (select_experts -> get_weight_prefetch_method()). The runner itself is not
            # built: its module imports numba (vLLM's n-gram proposer), not needed for anything tested here.
            from vllm_ascend.ascend_config import get_ascend_config
            from vllm_ascend.utils import set_weight_prefetch_method

            set_weight_prefetch_method(get_ascend_config().weight_prefetch_config)
        _context.update(config=cfg, ckpt=ckpt_dir, dtype=dtype)
        return cfg, ckpt_dir


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------

def build_case(cfg, seqs: Sequence[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int = 64,
               dtype: torch.dtype = torch.float32, seed: int = 0, sliding_window: int | None = None) -> Case:
    """One attention batch laid out as vLLM + vllm-ascend (0.15 ... 0.19.1) would, with the release's own metadata.

    Args:
        cfg: the ``VllmConfig`` from :func:`vllm_context`.
        seqs: per sequence ``(context_len, new_len)``: tokens already in the KV cache, tokens computed now.
        num_heads / num_kv_heads / head_dim: per-rank attention geometry (GQA ``num_heads // num_kv_heads``).
        dtype: q/k/v and KV-cache dtype.
        seed: generator seed; physical KV blocks are assigned in shuffled order, unused cache rows are random,
            except block :data:`NULL_BLOCK`, which is all zeros and never assigned (vLLM's null block).
        sliding_window: selects the KV-cache spec given to the builder (``SlidingWindowSpec`` as vLLM 0.15's
            ``Attention.get_kv_cache_spec`` makes for SW layers, else ``FullAttentionSpec``); 0.15's builder
            does not read it, but it is what the model runner passes.

    Returns:
        A :class:`~gptoss_patch.selftest.attention.Case`: ``query`` ``[T, N, D]``, ``key``/``value``
        ``[T, KV_N, D]`` (the shapes vLLM 0.15's ``Attention.forward`` hands the impl), caches
        ``[num_blocks, 128, KV_N, D]``, ``metadata`` an ``AscendMetadata`` from
        ``AscendAttentionMetadataBuilder.build(0, common)``; ``full_k``/``full_v`` per sequence ``[Skv, KV_N, D]``.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    bs = BLOCK_SIZE
    n_blocks_each = [-(-(c + n) // bs) for c, n in seqs]
    total_blocks = sum(n_blocks_each) + 2
    perm = 1 + torch.randperm(total_blocks - 1, generator=g)  # block 0 is vLLM's null block, never assigned
    block_table = torch.zeros(len(seqs), max(n_blocks_each), dtype=torch.int32)
    k_cache = torch.randn(total_blocks, bs, num_kv_heads, head_dim, generator=g).to(dtype)  # garbage outside seqs
    v_cache = torch.randn(total_blocks, bs, num_kv_heads, head_dim, generator=g).to(dtype)
    k_cache[NULL_BLOCK] = 0  # vLLM's BlockPool reserves block 0 as the null block; vllm-ascend 0.15 allocates the
    v_cache[NULL_BLOCK] = 0  # KV cache with torch.zeros (model_runner_v1.py) and no slot ever maps into it
    q_parts, k_parts, v_parts, slots, full_k, full_v = [], [], [], [], [], []
    nxt = 0
    for i, (c, n) in enumerate(seqs):
        blocks = perm[nxt:nxt + n_blocks_each[i]]
        nxt += n_blocks_each[i]
        block_table[i, :len(blocks)] = blocks.to(torch.int32)
        kk = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        vv = torch.randn(c + n, num_kv_heads, head_dim, generator=g).to(dtype)
        full_k.append(kk)
        full_v.append(vv)
        for p in range(c):
            k_cache[blocks[p // bs], p % bs] = kk[p]
            v_cache[blocks[p // bs], p % bs] = vv[p]
        q_parts.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        k_parts.append(kk[c:])
        v_parts.append(vv[c:])
        slots += [int(blocks[p // bs]) * bs + p % bs for p in range(c, c + n)]
    q_lens = [n for _, n in seqs]
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
    num_actual = int(sum(q_lens))
    state = attn_state_for(seqs, cfg.scheduler_config.enable_chunked_prefill)
    # NPU memory as the model runner keeps it (``query_start_loc.gpu``, ``seq_lens`` on the device, the block table
    # and slot mapping; ``*_cpu`` on the host: vllm_ascend/worker/model_runner_v1.py of 0.15.0rc1 - 0.19.1rc1)
    common = AscendCommonAttentionMetadata(
        query_start_loc=q_start.to(NPU), query_start_loc_cpu=q_start, seq_lens=seq_lens.to(NPU),
        seq_lens_cpu=seq_lens, num_computed_tokens_cpu=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        num_reqs=len(seqs), num_actual_tokens=num_actual, max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), block_table_tensor=block_table.to(NPU),
        slot_mapping=torch.tensor(slots, dtype=torch.int32).to(NPU), causal=True, num_input_tokens=num_actual,
        actual_seq_lengths_q=q_start[1:].tolist(), positions=None, attn_state=state, decode_token_per_req=1)
    spec_dtype = getattr(torch, cfg.model_config.dtype) if isinstance(cfg.model_config.dtype, str) else \
        cfg.model_config.dtype
    if sliding_window is None:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=spec_dtype)
    else:
        spec = SlidingWindowSpec(block_size=bs, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=spec_dtype,
                                 sliding_window=sliding_window)
    builder = AscendAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], cfg, torch.device(NPU))
    metadata = builder.build(0, common)
    query = torch.cat(q_parts).to(NPU)
    key = torch.cat(k_parts).to(NPU)
    value = torch.cat(v_parts).to(NPU)
    return Case(list(seqs), num_heads, num_kv_heads, head_dim, query, key, value, k_cache.to(NPU), v_cache.to(NPU),
                metadata, state, full_k, full_v)


def make_impl(cfg, *, num_heads: int, num_kv_heads: int, sliding_window: int | None, sinks: torch.Tensor | None,
              head_dim: int = 64, gpt_oss: bool = True):
    """The release's ``AscendAttentionBackendImpl`` built with the positional arguments of vLLM 0.15's
    ``Attention.__init__`` (``num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
    kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name``) and ``sinks=`` as the extra
    impl argument GPT-OSS passes (vllm/model_executor/models/gpt_oss.py ``OAIAttention``); scale ``D**-0.5``.

    ``gpt_oss``: build it as ``GptOssForCausalLM.__init__`` does (:func:`gptoss_patch._state.building_gpt_oss`), so
    patches acting on construction apply (layout I's ``attention.band_128_keys``); False builds upstream's impl as
    another model would get it (the calibration of upstream's own band)."""
    import contextlib

    from vllm.config import set_current_vllm_config
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

    from gptoss_patch import _state

    with set_current_vllm_config(cfg), (_state.building_gpt_oss() if gpt_oss else contextlib.nullcontext()):
        return AscendAttentionBackendImpl(num_heads, head_dim, head_dim ** -0.5, num_kv_heads, None, sliding_window,
                                          "auto", None, "decoder", None,
                                          sinks=None if sinks is None else sinks.to(NPU))  # the layer's parameter


class _Layer:
    """What 0.15's ``forward`` reads from the vLLM ``Attention`` layer (it asserts unit k/v scales)."""

    _k_scale_float = 1.0
    _v_scale_float = 1.0
    layer_name = "model.layers.0.self_attn.attn"


def run_native_forward(cfg, impl, case: Case, metadata=None, upstream: bool = False) -> torch.Tensor:
    """Run the release's eager ``AscendAttentionBackendImpl.forward`` on ``case``.

    The call is what ``vllm.attention.layer.unified_attention_with_output`` makes - ``impl.forward(layer,
    query [T,N,D], key [T,KV_N,D], value, kv_cache=(key_cache, value_cache), attn_metadata, output=[T,N,D])`` -
    inside ``set_ascend_forward_context`` (eager: ``capturing`` False). ``metadata`` overrides
    ``case.metadata``. The caches are cloned, so a case can be run more than once.

    ``upstream``: run upstream's own ``forward_impl`` even where gptoss-patch wraps it (layouts H and G,
    ``attention.sink_window_forward_impl``) - the calibration measures vllm-ascend's code, not ours. The original is
    bound on this ``impl`` only (an instance attribute shadowing the class's wrapper) for the call.

    Returns:
        The output buffer ``[T, N, D]`` in the query dtype (pre-filled with NaN, so rows the forward leaves
        unwritten show).
    """
    from vllm.config import set_current_vllm_config
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    md = case.metadata if metadata is None else metadata
    out = torch.full((case.num_tokens, case.num_heads, case.head_dim), float("nan"), dtype=case.query.dtype,
                     device=NPU)
    kv = (case.key_cache.clone(), case.value_cache.clone())
    from gptoss_patch.registry import MARKER

    ours = inspect.getattr_static(type(impl), "forward_impl")
    original = ours.__wrapped__ if upstream and hasattr(ours, MARKER) else None  # only gptoss-patch's wrapper
    if original is not None:
        impl.forward_impl = types.MethodType(original, impl)
    try:
        with set_current_vllm_config(cfg), set_ascend_forward_context({_Layer.layer_name: md}, cfg,
                                                                      num_tokens=case.num_tokens):
            ret = impl.forward(_Layer(), case.query, case.key, case.value, kv, md, output=out)
    finally:
        impl.__dict__.pop("forward_impl", None)
    assert ret.data_ptr() == out.data_ptr()
    return out


# --------------------------------------------------------------------------------------------------
# whole model (MoE)
# --------------------------------------------------------------------------------------------------

@dataclass
class NativeModel:
    """vLLM's ``GptOssForCausalLM`` loaded by vLLM's ``get_model`` with the installed vllm-ascend's ops."""

    config: Any
    model: torch.nn.Module


def load_native_model(cfg) -> NativeModel:
    """Load the cell's checkpoint with vLLM's own model loader, on the simulated NPU.

    ``vllm.model_executor.model_loader.get_model`` builds ``GptOssForCausalLM`` under the config's default
    dtype; ``FusedMoE`` is replaced by vllm-ascend's ``AscendFusedMoE`` (its ``CustomOp`` OOT registration
    from ``register_ascend_customop``), weights go through ``GptOssModel._load_weights_other`` and
    ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` (transpose to ``[E, H, 2I]`` /
    ``[E, I, H]``; ND unless ``VLLM_ASCEND_ENABLE_NZ=2``).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(cfg):
        model = get_model(vllm_config=cfg)
    return NativeModel(cfg, model.eval())


def run_native_moe(native: NativeModel, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """``model.model.layers[layer].mlp(hidden)`` (vLLM's ``MLPBlock.forward``: router Linear, then the
    ``AscendFusedMoE``) inside ``set_ascend_forward_context`` as the model runner sets it for an eager step.

    Args:
        hidden: ``[T, H]`` in the model dtype.

    Returns:
        ``[T, H]``.
    """
    from vllm.config import set_current_vllm_config
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    from vllm.forward_context import get_forward_context

    cfg = native.config
    mlp = native.model.model.layers[layer].mlp
    with torch.no_grad(), set_current_vllm_config(cfg), set_ascend_forward_context(None, cfg,
                                                                                    num_tokens=hidden.shape[0]):
        fc = get_forward_context()
        # vLLM binds the n-th moe_forward call of a forward pass to the n-th MoE layer: vLLM 0.15 pops
        # ForwardContext.remaining_moe_layers; vLLM >= 0.16 indexes ForwardContext.all_moe_layers with the counter
        # moe_layer_index (vllm/forward_context.py; get_layer_from_name in fused_moe/layer.py, in 0.18+
        # fused_moe/runner/default_moe_runner.py). A step runs every layer in order; running one layer alone, the
        # list must name that layer only, or the call would execute layer 0.
        name = mlp.experts.layer_name
        if hasattr(fc, "remaining_moe_layers"):
            if fc.remaining_moe_layers is None:
                raise RuntimeError("vLLM did not set ForwardContext.remaining_moe_layers; revisit run_native_moe")
            fc.remaining_moe_layers = [name]
            out = mlp(hidden)
            called = not fc.remaining_moe_layers
        elif hasattr(fc, "all_moe_layers") and hasattr(fc, "moe_layer_index"):
            if fc.all_moe_layers is None:
                # compilation_config.fast_moe_cold_start off (vLLM 0.17+ turns it off under enforce_eager,
                # vllm/config/vllm.py): the layer passes its own name to moe_forward (_encode_layer_name), nothing
                # is bound by position; the counter must stay untouched.
                out = mlp(hidden)
                called = fc.moe_layer_index == 0
            else:
                fc.all_moe_layers = [name]
                fc.moe_layer_index = 0
                out = mlp(hidden)
                called = fc.moe_layer_index == 1
        else:
            raise RuntimeError("vLLM's ForwardContext has neither remaining_moe_layers (0.15) nor all_moe_layers / "
                               "moe_layer_index (0.16+); revisit run_native_moe")
        if not called:
            raise RuntimeError(f"the MoE layer {name} was not called through moe_forward")
        return out



def load_reference_model(ckpt_dir: str):
    """transformers' ``GptOssForCausalLM.from_pretrained(ckpt_dir)`` in float32, eval mode: the MoE oracle
    (``model.model.layers[i].mlp`` is ``GptOssMLP``: top-k router with softmax over the chosen logits, interleaved
    gate/up, ``clamp(gate, max=7)``, ``clamp(up, -7, 7)``, ``(up + 1) * gate * sigmoid(1.702 * gate)``, both expert
    biases; transformers/models/gpt_oss/modeling_gpt_oss.py)."""
    from transformers import GptOssForCausalLM

    return GptOssForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()


def moe_input(layer: int, tokens: int, hidden_size: int = 64) -> torch.Tensor:
    """The calibration input of MoE ``layer`` for ``tokens`` rows: ``N(0, 9)`` float32 ``[tokens, hidden_size]``,
    seeded by ``100 * layer + tokens`` (the same tensor in every process, so a child interpreter measures the same
    case). The scale makes gate/up pre-activations cross GPT-OSS's clamps at +-7."""
    return torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(100 * layer + tokens)) * 3


def moe_relative_error(native: NativeModel, reference, layer: int, hidden: torch.Tensor) -> float:
    """``||native - reference|| / ||reference||`` (Frobenius) of MoE ``layer`` on ``hidden`` ``[T, H]`` float32:
    :func:`run_native_moe` against transformers' ``GptOssMLP`` (:func:`load_reference_model`)."""
    got = run_native_moe(native, layer, hidden)
    with torch.no_grad():
        want, _ = reference.model.layers[layer].mlp(hidden.unsqueeze(0))
    want = want[0]
    return ((got - want).norm() / want.norm()).item()
