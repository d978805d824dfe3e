"""Bring up the real vLLM + vllm-ascend worker state in this process, on whatever ``torch_npu`` is present: the real one
on an Ascend host (``verify --selftest`` there; the device group uses HCCL, :func:`distributed_backend`; that branch
has not run here: no NPU), or gptoss-patch-testkit's CPU simulator (gloo). The harness never chooses:
:mod:`gptoss_patch.selftest.device` asks the ``torch_npu`` present.

What ``NPUWorker.__init__`` / ``_init_worker_distributed_environment`` and ``NPUModelRunner`` do before a forward pass
(vllm_ascend/worker/worker_v1.py and model_runner_v1.py in 0.11.0 / 0.12.0rc1 / 0.13.0 / 0.14.0rc1; worker/worker.py in
0.15.0rc1), without an engine, a scheduler or worker processes, so tests and benchmarks can build real layers and call
them:

* :func:`engine_config` - ``EngineArgs(...).create_engine_config()`` with CPU-friendly defaults;
* :func:`ascend_context` - context manager: process-wide distributed init (once per process) and the per-config
  vllm-ascend init (``adapt_patch``, ``is_enable_nz``, ``register_ascend_customop``, ``init_ascend_config``, SoC
  version, and the process-wide state ``NPUModelRunner.__init__`` sets from 0.12.0rc1 on: MC2 capacity and mask,
  rope cos/sin buffers, weight-prefetch method), inside ``set_current_vllm_config``; yields the ``VllmConfig``;
* :func:`load_model` - the model through vLLM's own loader (checkpoint weights, ``process_weights_after_loading``);
* :func:`layout` - the module-layout family (``gptoss_patch.matrix.LAYOUTS`` key) of the installed vllm-ascend;
* :func:`worker_patch_report` - which of vllm-ascend's worker patch modules are applied, and which could not be;
* :func:`forward_context` - vllm-ascend's forward context for ``num_tokens`` tokens, with the MoE communication method
  the model runner would pick (or the one you name).

Example::

    from gptoss_patch.selftest import worker as vllm_setup
    with vllm_setup.ascend_context(ckpt_dir, dtype="float32") as cfg:
        model = vllm_setup.load_model(cfg)
        with vllm_setup.forward_context(cfg, num_tokens=16):
            y = model.model.layers[0].mlp(x)

Requirements: a ``torch_npu`` - off an NPU, the testkit's simulator with ``GPTOSS_PATCH_SIMULATE_NPU=1`` in the
environment before vLLM is first imported (vLLM inspects the model registry in a child interpreter, which must see the
simulator too). :func:`ascend_context` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` if unset. The first
:func:`engine_config` of a machine takes ~50 s (vLLM's registry inspection, cached afterwards in ``~/.cache/vllm``).

Worker patches: ``adapt_patch()`` imports ``vllm_ascend/patch/worker/__init__.py``. In vllm-ascend 0.12.0rc1
(``patch_qwen2_5_vl``, ``patch_qwen2_5_omni``, ``patch_qwen3_vl``) and 0.13.0 (``patch_qwen3vl``) some of those
patch modules import ``torchvision`` (through transformers' Qwen-VL video processors), which cannot be imported beside
the cells' CPU torch 2.13 (the PyPI torchvision wheels link ``libtorch_cuda``). There the testkit's loader runs the
package's statements one at a time, as its import would run them, and skips only the statements that need
``torchvision`` (all of them patch vision-language models; :func:`worker_patch_report` lists them). Every other worker
patch is applied; on an NPU host nothing is skipped.

Limits: one distributed world per process (the first :func:`ascend_context` fixes world size, rank and the TP/PP
sizes; a later config with other sizes raises). Several configs (dtype, expert parallel on/off, checkpoints) can be used
one after another in a process. Layer names must be unique per config (vLLM's static forward context).
"""

from __future__ import annotations

import contextlib
import inspect
import atexit
import os
import shutil
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
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from gptoss_patch.selftest import device

    device.torch_npu()  # the torch_npu present serves (real, or the testkit's simulator); ImportError with a hint


def distributed_backend() -> str:
    """:func:`gptoss_patch.selftest.device.distributed_backend` (``"hccl"`` on a real NPU, ``"gloo"`` simulated)."""
    from gptoss_patch.selftest import device

    return device.distributed_backend()


def engine_config(checkpoint_dir: str | os.PathLike, **engine_args: Any):
    """``EngineArgs(model=checkpoint_dir, **ENGINE_DEFAULTS | engine_args).create_engine_config()`` (vLLM).

    Args:
        checkpoint_dir: a Hugging Face checkpoint directory (e.g. :func:`gptoss_patch.selftest.tiny.write_checkpoint`).
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


def process_scratch(prefix: str, *, directory: bool = True) -> str:
    """A fresh path under the system temporary directory, removed when this process exits normally.

    Args:
        prefix: file-name prefix (``gptoss-...``).
        directory: create a directory (``True``) or return the name of a file that does not exist yet (``False``;
            the ``file://`` rendezvous of ``torch.distributed``'s ``FileStore``, which creates it).

    Returns:
        The absolute path. An ``atexit`` handler removes it (and everything under it): each test child that builds
        a checkpoint or a distributed world would otherwise leave ~70 MB (a tiny checkpoint) behind, and a CI
        machine fills up over many runs. A process killed by a signal leaves its scratch behind.
    """
    if directory:
        path = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    else:
        fd, path = tempfile.mkstemp(prefix=prefix)
        os.close(fd)
        os.unlink(path)
        atexit.register(_unlink_quietly, path)
    return path


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


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

    method = distributed_init_method or f"file://{process_scratch('gptoss-dist-', directory=False)}"
    init_distributed_environment(world_size=pc.world_size, rank=rank, distributed_init_method=method,
                                 local_rank=rank, backend=distributed_backend())
    ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
    from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

    init_ascend_model_parallel(pc)
    _world = want


def layout() -> str:
    """The module-layout family of the installed vllm-ascend: a key of ``gptoss_patch.matrix.LAYOUTS``.

    The matrix row of this process's decision (``gptoss_patch.status().row``) when there is one, else the row
    :func:`gptoss_patch.matrix.decide` picks for the installed versions (``GPTOSS_PATCH_DISABLE=1`` still runs on a
    known layout).

    Raises:
        RuntimeError: the installed vllm-ascend maps to no row with a layout (refused, or natively supported
            releases, which have nothing patched and no layout).
    """
    import gptoss_patch
    from gptoss_patch import environment, matrix

    release = gptoss_patch.status().row
    row = next((r for r in matrix.ROWS if r.vllm_ascend == release), None)
    if row is None or row.layout is None:
        v = environment.installed_versions()
        row = matrix.decide(v.vllm_ascend, v.vllm).row
    if row is None or row.layout is None:
        v = environment.installed_versions()
        raise RuntimeError(f"vllm-ascend {v.vllm_ascend} with vllm {v.vllm} has no module layout in "
                           f"gptoss_patch.matrix (layouts exist for the apply rows: "
                           f"{', '.join(matrix.supported_releases())})")
    return row.layout


def worker_patch_report() -> dict[str, list[str]]:
    """``{"applied": [...], "skipped": [...]}``: vllm-ascend worker patch modules imported in this process, and the
    statements of ``vllm_ascend/patch/worker/__init__.py`` that were skipped (the testkit's loader, which tolerates a
    missing ``torchvision`` in the test environment, records them on the package as ``__gptoss_skipped__``; on an
    NPU host nothing is skipped)."""
    import sys

    applied = sorted(m for m in sys.modules if m.startswith("vllm_ascend.patch.worker.patch_"))
    package = sys.modules.get("vllm_ascend.patch.worker")
    return {"applied": applied, "skipped": list(getattr(package, "__gptoss_skipped__", ()))}


def adapt_worker_patches() -> None:
    """``vllm_ascend.utils.adapt_patch()`` (``from vllm_ascend.patch import worker``), as ``NPUWorker.__init__`` does
    (idempotent: a second call imports nothing).

    Raises:
        whatever a worker patch raises (in the test environment, gptoss-patch-testkit's loader skips the vision-model
        statements that need ``torchvision``: docs/simulator.md §6).
    """
    import sys

    import vllm_ascend.utils as vu

    if "vllm_ascend.patch.worker" in sys.modules:
        return
    vu.adapt_patch()


def _init_runner_globals(cfg: Any) -> None:
    """The process-wide state ``NPUModelRunner.__init__`` sets before the first forward pass, per release.

    0.12.0rc1 - 0.14.0rc1 (``model_runner_v1.py`` ``NPUModelRunner.__init__``): ``set_cos_and_sin(vllm_config,
    max_num_reqs, decode_token_per_req, dtype, device)`` (``ascend_forward_context`` in 0.12.0rc1,
    ``ops.rotary_embedding`` from 0.13.0), ``set_mc2_tokens_capacity(vllm_config, max_num_reqs,
    uniform_decode_query_len)`` and ``set_mc2_mask(vllm_config, device)`` (``ascend_forward_context``); 0.13.0+ also
    ``set_weight_prefetch_method(ascend_config.weight_prefetch_config)``. Each upstream setter keeps its first value
    (one model runner per process). 0.11.x keeps these in the runner object instead (see :func:`forward_context`).
    """
    import importlib

    import torch

    afc = importlib.import_module("vllm_ascend.ascend_forward_context")
    rope = importlib.import_module("vllm_ascend.ops.rotary_embedding")
    spec = cfg.speculative_config
    per_req = 1 + (spec.num_speculative_tokens if spec else 0)
    max_num_reqs = cfg.scheduler_config.max_num_seqs
    device = torch.device("npu")  # the model runner's device (the simulator maps it to host memory)
    set_cos_and_sin = getattr(rope, "set_cos_and_sin", None) or getattr(afc, "set_cos_and_sin", None)
    if set_cos_and_sin is not None:
        set_cos_and_sin(cfg, max_num_reqs, per_req, cfg.model_config.dtype, device)
    if hasattr(afc, "set_mc2_tokens_capacity"):
        afc.set_mc2_tokens_capacity(cfg, max_num_reqs, per_req)
        afc.set_mc2_mask(cfg, device)


def register_atb_extensions() -> None:
    """Load torch_npu's ATB operator library as ``NPUWorker.__init__`` does before the model is built: ``torch.ops.atb``
    and the ATB operators the attention paths launch (``_npu_reshape_and_cache``, ``_npu_flash_attention``...) exist
    only after it. Skipped on an Atlas A5 from the releases that skip it there (``get_ascend_device_type() !=
    AscendDeviceType.A5``). Sources: vllm_ascend 0.11.0 ``worker/worker_v1.py`` (unconditional), 0.15.0rc1 ...
    0.19.1rc1 ``worker/worker.py``; torch_npu ``op_plugin/atb/_atb_ops.py``.

    Raises:
        ImportError: the torch_npu present has no ``op_plugin.atb._atb_ops`` (every torch_npu vllm-ascend pins has).
    """
    import vllm_ascend.utils as vu
    from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions

    kind = getattr(vu, "AscendDeviceType", None)
    if kind is not None and hasattr(kind, "A5") and vu.get_ascend_device_type() == kind.A5:
        return
    _register_atb_extensions()


def _init_ascend(cfg: Any, worker_patches: bool) -> None:
    """The vllm-ascend part of ``NPUWorker.__init__`` for ``cfg`` (idempotent parts stay idempotent)."""
    import vllm_ascend.utils as vu
    from vllm_ascend import ops
    from vllm_ascend.ascend_config import init_ascend_config

    if worker_patches:
        adapt_worker_patches()
    if "vllm_config" in inspect.signature(getattr(vu, "is_enable_nz", lambda: None)).parameters:
        # 0.11.x: caches its answer for the config of the first call; recompute for this config (0.12.0rc1 reads an
        # environment variable, 0.13+ has maybe_trans_nz instead)
        if hasattr(vu, "_ENABLE_NZ"):
            vu._ENABLE_NZ = None
        vu.is_enable_nz(vllm_config=cfg)
    ops.register_dummy_fusion_op()
    register_atb_extensions()
    vu.register_ascend_customop(cfg)
    init_ascend_config(cfg)
    for name in ("init_ascend_soc_version", "check_ascend_device_type"):  # 0.11.x / 0.15
        fn = getattr(vu, name, None)
        if fn is not None:
            fn()
            break
    if hasattr(vu, "set_weight_prefetch_method"):  # 0.13+: NPUModelRunner.__init__ sets it; select_experts reads it
        from vllm_ascend.ascend_config import get_ascend_config

        vu.set_weight_prefetch_method(get_ascend_config().weight_prefetch_config)
    _init_runner_globals(cfg)


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
        worker_patches: apply vllm-ascend's worker patches (``adapt_patch()``) as the worker does; statements of the
            worker patch package that need ``torchvision`` are skipped (module docstring, "Worker patches"). Pass
            ``False`` to leave them out altogether. Once applied they stay applied.

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

    Per layout (:func:`layout`):

    * E, F (0.13.0+): ``vllm_ascend.ascend_forward_context.select_moe_comm_method(num_tokens, vllm_config)`` itself
      (``set_ascend_forward_context`` calls it; ``with_prefill`` plays no part).
    * C (0.12.0rc1): the rules of ``NPUModelRunner._select_moe_comm_method`` (vllm_ascend/worker/model_runner_v1.py),
      restated because importing that module needs ``numba``: no expert parallel -> ALLGATHER; A2 -> MC2 if
      ``num_tokens <= get_mc2_tokens_capacity()`` and ``world_size_across_dp / pipeline_parallel_size >= 16``, else
      ALLTOALL for ``moe_quantize``/``quantize == "w4a8_dynamic"``, else ALLGATHER; A3 -> MC2 up to the capacity, else
      FUSED_ALLTOALL for ``w8a8_dynamic`` with an EP group of <= 16 ranks, else ALLTOALL; PanguProMoE -> ALLGATHER.
      ``with_prefill`` plays no part.
    * B (0.11.x): the rules of 0.11's ``NPUModelRunner._select_moe_comm_method``: no expert parallel -> ALLGATHER;
      A2 -> MC2 if ``num_tokens <= mc2_tokens_capacity`` and ``world_size_across_dp >= 16``, else ALLTOALL for
      ``moe_quantize == "w4a8_dynamic"``, else ALLGATHER; A3 -> MC2 up to the capacity, else ALLTOALL; then ALLGATHER
      with a prefill becomes NAIVE_MULTICAST unless sequence parallelism is on; PanguProMoE -> ALLGATHER.

    Raises:
        ValueError: an SoC other than A2/A3 (as upstream).
    """
    import vllm_ascend.ascend_forward_context as afc

    if hasattr(afc, "select_moe_comm_method"):
        return afc.select_moe_comm_method(num_tokens, vllm_config)
    from vllm_ascend.utils import is_moe_model

    MoECommType = afc.MoECommType
    if not is_moe_model(vllm_config):
        return None
    hf = vllm_config.model_config.hf_config
    pc = vllm_config.parallel_config
    if layout() == "C":
        from vllm.distributed.parallel_state import get_ep_group
        from vllm_ascend.utils import AscendDeviceType, get_ascend_device_type

        capacity = afc.get_mc2_tokens_capacity()
        soc = get_ascend_device_type()
        quant = getattr(hf, "moe_quantize", getattr(hf, "quantize", None))
        if not pc.enable_expert_parallel:
            chosen = MoECommType.ALLGATHER
        elif soc in {AscendDeviceType._910B}:
            if num_tokens <= capacity and pc.world_size_across_dp / pc.pipeline_parallel_size >= 16:
                chosen = MoECommType.MC2
            elif quant == "w4a8_dynamic":
                chosen = MoECommType.ALLTOALL
            else:
                chosen = MoECommType.ALLGATHER
        elif soc in {AscendDeviceType._910_93}:
            chosen = (MoECommType.MC2 if num_tokens <= capacity else
                      MoECommType.FUSED_ALLTOALL if quant == "w8a8_dynamic" and get_ep_group().world_size <= 16
                      else MoECommType.ALLTOALL)
        else:
            raise ValueError(f"Unsupported soc_version: {soc}")
        if hf.model_type == "PanguProMoE":
            chosen = MoECommType.ALLGATHER
        return chosen
    from vllm_ascend.utils import AscendSocVersion, enable_sp, get_ascend_soc_version

    soc = get_ascend_soc_version()
    capacity = mc2_tokens_capacity(vllm_config)
    if not pc.enable_expert_parallel:
        chosen = MoECommType.ALLGATHER
    elif soc == AscendSocVersion.A2:
        if num_tokens <= capacity and pc.world_size_across_dp >= 16:
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
                    in_profile_run: bool = False, attn_metadata: Any = None, num_actual_tokens: int | None = None,
                    cudagraph_runtime_mode: Any = None, batch_descriptor: Any = None,
                    model_instance: Any = None) -> Iterator[Any]:
    """vllm-ascend's forward context for a step of ``num_tokens`` tokens, as ``NPUModelRunner.execute_model`` sets it.

    Args:
        vllm_config: the config (its layers are looked up by name from its static forward context).
        num_tokens: tokens in the step (the padded count the runner passes).
        with_prefill: the step contains a prefill (0.11.x picks NaiveMulticast over AllGather then; 0.12.0rc1 stores
            it in the context; later releases do not take it).
        moe_comm_type: a ``vllm_ascend.ascend_forward_context.MoECommType`` to force; default
            :func:`select_moe_comm_type` (0.13+: ``set_ascend_forward_context`` selects it itself; a forced type is
            then put into the context afterwards, with its communication method).
        in_profile_run: vLLM's memory-profiling run (upstream then routes tokens to random experts).
        attn_metadata: attention metadata, a dict layer name -> metadata (``None`` for MoE-only calls).
        num_actual_tokens: the unpadded token count (default ``num_tokens``).
        cudagraph_runtime_mode: ``vllm.config.CUDAGraphMode`` the runner dispatched (default NONE).
        batch_descriptor: ``vllm.forward_context.BatchDescriptor`` the runner dispatched.
        model_instance: the model (the runner passes ``self.model``; vllm-ascend reads ``model.model.start_layer``).

    Yields:
        vLLM's ``ForwardContext`` (with vllm-ascend's fields: ``moe_comm_type``, ``moe_comm_method``, ...).
    """
    import torch
    from vllm.forward_context import get_forward_context
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context

    params = inspect.signature(set_ascend_forward_context).parameters
    selected_inside = "moe_comm_type" not in params  # 0.13+
    if moe_comm_type is None and not selected_inside:
        moe_comm_type = select_moe_comm_type(vllm_config, num_tokens, with_prefill)
    kwargs: dict[str, Any] = {"num_tokens": num_tokens, "in_profile_run": in_profile_run,
                              "num_actual_tokens": num_tokens if num_actual_tokens is None else num_actual_tokens,
                              "model_instance": model_instance}
    if cudagraph_runtime_mode is not None:
        kwargs["aclgraph_runtime_mode"] = cudagraph_runtime_mode
    if batch_descriptor is not None:
        kwargs["batch_descriptor"] = batch_descriptor
    if not selected_inside:  # 0.11.x / 0.12.0rc1: the runner passes its choice
        kwargs.update(moe_comm_type=moe_comm_type, with_prefill=with_prefill)
    if "reserved_mc2_mask" in params:  # 0.11.x: and its MC2 mask buffer (0.12+: set_mc2_mask, module state)
        kwargs["reserved_mc2_mask"] = torch.zeros(mc2_tokens_capacity(vllm_config), dtype=torch.bool)
    with set_ascend_forward_context(attn_metadata, vllm_config, **kwargs):
        ctx = get_forward_context()
        if selected_inside and moe_comm_type is not None and moe_comm_type != ctx.moe_comm_type:
            import importlib

            mod = importlib.import_module("vllm_ascend.ops.fused_moe.moe_comm_method")
            ctx.moe_comm_type = moe_comm_type
            ctx.moe_comm_method = mod.get_moe_comm_method(moe_comm_type)
        yield ctx
