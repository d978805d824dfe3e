"""Bring up the real vLLM + vllm-ascend worker state in this process, on the CPU NPU simulator.

What ``NPUWorker.__init__`` / ``_init_worker_distributed_environment`` and ``NPUModelRunner`` do before a forward pass
(vllm_ascend/worker/worker_v1.py and model_runner_v1.py in 0.11.0 / 0.12.0rc1 / 0.13.0 / 0.14.0rc1; worker/worker.py in
0.15.0rc1), without an engine, a scheduler or worker processes, so tests and benchmarks can build real layers and call
them:

* :func:`engine_config` - ``EngineArgs(...).create_engine_config()`` with CPU-friendly defaults;
* :func:`ascend_context` - context manager: process-wide distributed init (gloo, once per process) and the per-config
  vllm-ascend init (``adapt_patch``, ``is_enable_nz``, ``register_ascend_customop``, ``init_ascend_config``, SoC
  version), inside ``set_current_vllm_config``; yields the ``VllmConfig``;
* :func:`load_model` - the model through vLLM's own loader (checkpoint weights, ``process_weights_after_loading``);
* :func:`layout` - the module-layout family (``gptoss_patch.matrix.LAYOUTS`` key) of the installed vllm-ascend;
* :func:`worker_patch_report` - which of vllm-ascend's worker patch modules are applied, and which could not be;
* :func:`forward_context` - vllm-ascend's forward context for ``num_tokens`` tokens, with the MoE communication method
  the model runner would pick (or the one you name).

Example::

    from gptoss_patch.testing import vllm_setup
    with vllm_setup.ascend_context(ckpt_dir, dtype="float32") as cfg:
        model = vllm_setup.load_model(cfg)
        with vllm_setup.forward_context(cfg, num_tokens=16):
            y = model.model.layers[0].mlp(x)

Requirements: ``GPTOSS_PATCH_SIMULATE_NPU=1`` in the environment before vLLM is first imported (vLLM inspects the model
registry in a child interpreter, which must see the simulator too); :func:`ascend_context` sets it and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` if unset and installs the simulator in this process. The first
:func:`engine_config` of a machine takes ~50 s (vLLM's registry inspection, cached afterwards in ``~/.cache/vllm``).

Worker patches: ``adapt_patch()`` imports ``vllm_ascend/patch/worker/__init__.py``. In vllm-ascend 0.12.0rc1
(``patch_qwen2_5_vl``, ``patch_qwen2_5_omni``, ``patch_qwen3_vl``) and 0.13.0 (``patch_qwen3vl``) some of those
patch modules import ``torchvision`` (through transformers' Qwen-VL video processors), which cannot be imported beside
the cells' CPU torch 2.13 (the PyPI torchvision wheels link ``libtorch_cuda``). Then the package's statements are run
one at a time, as its import would run them, and only the statements that need ``torchvision`` are skipped (all of
them patch vision-language models; :func:`worker_patch_report` lists them). Every other worker patch is applied.

Limits: one distributed world per process (the first :func:`ascend_context` fixes world size, rank and the TP/PP
sizes; a later config with other sizes raises). Several configs (dtype, expert parallel on/off, checkpoints) can be used
one after another in a process. Layer names must be unique per config (vLLM's static forward context).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import threading
from typing import Any, Iterator

__all__ = ["engine_config", "ascend_context", "load_model", "forward_context", "select_moe_comm_type",
           "mc2_tokens_capacity", "layout", "worker_patch_report", "ENGINE_DEFAULTS"]

#: Defaults for :func:`engine_config` (each can be overridden by keyword).
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "max_model_len": 1024,
    "skip_tokenizer_init": True,
    "block_size": 128,
}

_lock = threading.RLock()
_world: dict[str, int] | None = None


def _prepare_process() -> None:
    os.environ.setdefault("GPTOSS_PATCH_SIMULATE_NPU", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from gptoss_patch.testing import npu_sim

    npu_sim.install()


def engine_config(checkpoint_dir: str | os.PathLike, **engine_args: Any):
    """``EngineArgs(model=checkpoint_dir, **ENGINE_DEFAULTS | engine_args).create_engine_config()`` (vLLM).

    Args:
        checkpoint_dir: a Hugging Face checkpoint directory (e.g. :func:`gptoss_patch.testing.tiny.write_checkpoint`).
        engine_args: any ``EngineArgs`` field, e.g. ``dtype="float32"``, ``enable_expert_parallel=True``,
            ``tensor_parallel_size=2``.

    Returns:
        ``vllm.config.VllmConfig``.

    Raises:
        whatever vLLM raises for an invalid configuration.
    """
    _prepare_process()
    from vllm.engine.arg_utils import EngineArgs

    args = dict(ENGINE_DEFAULTS)
    args.update(engine_args)
    return EngineArgs(model=str(checkpoint_dir), **args).create_engine_config()


def _init_world(cfg: Any, rank: int, distributed_init_method: str | None) -> None:
    global _world
    pc = cfg.parallel_config
    want = {"world_size": pc.world_size, "rank": rank, "tp": pc.tensor_parallel_size,
            "pp": pc.pipeline_parallel_size}
    if _world is not None:
        if _world != want:
            raise RuntimeError(f"this process was initialised for {_world}; a config needing {want} cannot be used "
                               "here (one distributed world per process)")
        return
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    method = distributed_init_method or f"file://{tempfile.mktemp(prefix='gptoss-dist-')}"
    init_distributed_environment(world_size=pc.world_size, rank=rank, distributed_init_method=method,
                                 local_rank=rank, backend="gloo")
    ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

    init_ascend_model_parallel(pc)
    _world = want


def _init_ascend(cfg: Any, worker_patches: bool) -> None:
    """The vllm-ascend part of ``NPUWorker.__init__`` for ``cfg`` (idempotent parts stay idempotent)."""
    import vllm_ascend.utils as vu
    from vllm_ascend import ops
    from vllm_ascend.ascend_config import init_ascend_config

    if worker_patches:
        vu.adapt_patch()
    if hasattr(vu, "is_enable_nz"):  # 0.11.x / 0.12: caches its answer on the first call; recompute for this config
        if hasattr(vu, "_ENABLE_NZ"):
            vu._ENABLE_NZ = None
        vu.is_enable_nz(vllm_config=cfg)
    ops.register_dummy_fusion_op()
    vu.register_ascend_customop(cfg)
    init_ascend_config(cfg)
    for name in ("init_ascend_soc_version", "check_ascend_device_type"):  # 0.11.x / 0.15
        fn = getattr(vu, name, None)
        if fn is not None:
            fn()
            break
    if hasattr(vu, "set_weight_prefetch_method"):  # 0.15: NPUModelRunner.__init__ sets it; select_experts reads it
        from vllm_ascend.ascend_config import get_ascend_config

        vu.set_weight_prefetch_method(get_ascend_config().weight_prefetch_config)


@contextlib.contextmanager
def ascend_context(checkpoint_dir: str | os.PathLike | None = None, *, vllm_config: Any = None, rank: int = 0,
                   distributed_init_method: str | None = None, worker_patches: bool = True,
                   **engine_args: Any) -> Iterator[Any]:
    """Worker state for one config; yields the ``VllmConfig`` (current for the duration, as vLLM's loader needs).

    Args:
        checkpoint_dir: build the config with :func:`engine_config` (``engine_args`` passed on); or
        vllm_config: use this ready config instead.
        rank: this process's global rank (multi-process tests: one process per rank).
        distributed_init_method: ``torch.distributed`` init URL shared by all ranks (``file://...`` or ``tcp://...``);
            default a fresh file (single process).
        worker_patches: apply vllm-ascend's worker patches (``adapt_patch()``) as the worker does. vllm-ascend
            0.15.0rc1's import ``torchvision`` (``patch_huanyuan_vl``), which the 0.15 venv lacks; pass ``False`` there
            when the code under test does not depend on them (the MoE path does not). Once applied they stay applied.

    Raises:
        ValueError: neither or both of ``checkpoint_dir`` / ``vllm_config``.
        RuntimeError: the process was initialised for another world (see module "Limits").
    """
    if (checkpoint_dir is None) == (vllm_config is None):
        raise ValueError("pass exactly one of checkpoint_dir or vllm_config")
    _prepare_process()
    cfg = vllm_config if vllm_config is not None else engine_config(checkpoint_dir, **engine_args)
    from vllm.config import set_current_vllm_config

    with _lock, set_current_vllm_config(cfg):
        _init_world(cfg, rank, distributed_init_method)
        _init_ascend(cfg, worker_patches)
        yield cfg


def load_model(vllm_config: Any):
    """The model of ``vllm_config`` through vLLM's loader (call inside :func:`ascend_context`). Returns the module."""
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(vllm_config.load_config).load_model(vllm_config=vllm_config,
                                                               model_config=vllm_config.model_config)


def mc2_tokens_capacity(vllm_config: Any) -> int:
    """vllm-ascend 0.11.x ``NPUModelRunner._init_mc2_tokens_capacity``: the largest step MC2 serves, a multiple of TP.

    ``cudagraph_capture_sizes[0]`` when graphs are captured, else ``min(max_num_seqs * (1 + spec tokens), 512)``,
    rounded up to a multiple of the tensor-parallel size.
    """
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes
    spec = vllm_config.speculative_config
    if sizes:
        max_num_tokens = sizes[0]
    else:
        max_num_tokens = min(vllm_config.scheduler_config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec
                                                                                else 0)), 512)
    tp = vllm_config.parallel_config.tensor_parallel_size
    return (max_num_tokens + tp - 1) // tp * tp


def select_moe_comm_type(vllm_config: Any, num_tokens: int, with_prefill: bool = True) -> Any:
    """The ``MoECommType`` vllm-ascend's model runner picks for a step of ``num_tokens`` (``None`` for a dense model).

    0.13+: ``vllm_ascend.ascend_forward_context.select_moe_comm_method`` itself. 0.11.x: the rules of
    ``NPUModelRunner._select_moe_comm_method`` (vllm_ascend/worker/model_runner_v1.py), restated here because importing
    that module needs ``numba`` (vLLM's n-gram proposer), which the cell venvs do not install: no expert parallel ->
    ALLGATHER; A2 -> MC2 if ``num_tokens <= mc2_tokens_capacity`` and ``world_size_across_dp >= 16``, else ALLTOALL
    for ``moe_quantize == "w4a8_dynamic"``, else ALLGATHER; A3 -> MC2 up to the capacity, else ALLTOALL; then
    ALLGATHER with a prefill becomes NAIVE_MULTICAST unless sequence parallelism is on; PanguProMoE -> ALLGATHER.

    Raises:
        ValueError: an SoC other than A2/A3 (as upstream).
    """
    import vllm_ascend.ascend_forward_context as afc

    if hasattr(afc, "select_moe_comm_method"):
        return afc.select_moe_comm_method(num_tokens, vllm_config)
    from vllm_ascend.utils import AscendSocVersion, enable_sp, get_ascend_soc_version, is_moe_model

    MoECommType = afc.MoECommType
    if not is_moe_model(vllm_config):
        return None
    hf = vllm_config.model_config.hf_config
    soc = get_ascend_soc_version()
    capacity = mc2_tokens_capacity(vllm_config)
    if not vllm_config.parallel_config.enable_expert_parallel:
        chosen = MoECommType.ALLGATHER
    elif soc == AscendSocVersion.A2:
        if num_tokens <= capacity and vllm_config.parallel_config.world_size_across_dp >= 16:
            chosen = MoECommType.MC2
        elif getattr(hf, "moe_quantize", None) == "w4a8_dynamic":
            chosen = MoECommType.ALLTOALL
        else:
            chosen = MoECommType.ALLGATHER
    elif soc == AscendSocVersion.A3:
        chosen = MoECommType.MC2 if num_tokens <= capacity else MoECommType.ALLTOALL
    else:
        raise ValueError(f"Unsupported soc_version: {soc}")
    if chosen == MoECommType.ALLGATHER and with_prefill and not enable_sp():
        chosen = MoECommType.NAIVE_MULTICAST
    if hf.model_type == "PanguProMoE":
        chosen = MoECommType.ALLGATHER
    return chosen


@contextlib.contextmanager
def forward_context(vllm_config: Any, num_tokens: int, *, with_prefill: bool = True, moe_comm_type: Any = None,
                    in_profile_run: bool = False, attn_metadata: Any = None) -> Iterator[Any]:
    """vllm-ascend's forward context for a step of ``num_tokens`` tokens, as ``NPUModelRunner.execute_model`` sets it.

    Args:
        vllm_config: the config (its layers are looked up by name from its static forward context).
        num_tokens: tokens in the step (the padded count the runner passes).
        with_prefill: the step contains a prefill (0.11.x picks NaiveMulticast over AllGather then).
        moe_comm_type: a ``vllm_ascend.ascend_forward_context.MoECommType`` to force; default
            :func:`select_moe_comm_type`.
        in_profile_run: vLLM's memory-profiling run (upstream then routes tokens to random experts).
        attn_metadata: attention metadata (``None`` for MoE-only calls).

    Yields:
        vLLM's ``ForwardContext`` (with vllm-ascend's fields: ``moe_comm_type``, ``moe_comm_method``, ...).
    """
    import torch
    from vllm.forward_context import get_forward_context
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    if moe_comm_type is None:
        moe_comm_type = select_moe_comm_type(vllm_config, num_tokens, with_prefill)
    params = inspect.signature(set_ascend_forward_context).parameters
    kwargs: dict[str, Any] = {"num_tokens": num_tokens, "in_profile_run": in_profile_run}
    if "moe_comm_type" in params:  # 0.11.x: the runner passes its choice and its MC2 mask buffer
        kwargs.update(moe_comm_type=moe_comm_type, with_prefill=with_prefill,
                      reserved_mc2_mask=torch.zeros(mc2_tokens_capacity(vllm_config), dtype=torch.bool),
                      num_actual_tokens=num_tokens)
    with set_ascend_forward_context(attn_metadata, vllm_config, **kwargs):
        ctx = get_forward_context()
        if "moe_comm_type" not in params and moe_comm_type != ctx.moe_comm_type:  # 0.13+: selected inside
            import importlib

            mod = importlib.import_module("vllm_ascend.ops.fused_moe.moe_comm_method")
            ctx.moe_comm_type = moe_comm_type
            ctx.moe_comm_method = mod.get_moe_comm_method(moe_comm_type)
        yield ctx
