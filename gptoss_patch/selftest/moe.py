"""GPT-OSS MoE test cases: random expert weights in transformers' layout, tokens, and the transformers oracle.

Shared by the MoE and padding cell tests. :func:`reference` runs transformers 4.57's ``GptOssMLP`` (router with
bias, softmax top-4 renormalised, ``gate_up_proj`` interleaved with bias, clamped swigluoai, ``down_proj`` with bias)
holding the weights - the independent oracle for vllm-ascend's MoE layer with our patches.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch

#: GPT-OSS experts per token.
TOP_K = 4


@dataclass
class Weights:
    """One GPT-OSS MoE block in transformers' layout, float32."""

    router_w: torch.Tensor  # [E, H]
    router_b: torch.Tensor  # [E]
    w13: torch.Tensor  # [E, H, 2I] gate/up interleaved
    b13: torch.Tensor  # [E, 2I]
    w2: torch.Tensor  # [E, I, H]
    b2: torch.Tensor  # [E, H]

    @property
    def dims(self):
        e, h, two_i = self.w13.shape
        return e, h, two_i // 2

    def rounded(self, dtype):
        """The same weights rounded to ``dtype`` and back to float32 (what a ``dtype`` model holds)."""
        return Weights(*(t.to(dtype).float() for t in (self.router_w, self.router_b, self.w13, self.b13, self.w2,
                                                        self.b2)))


def make_weights(num_experts, hidden, inter, seed, dead_experts=()):
    """Random weights whose gate/up pre-activations often pass the +-7 clamps (std ~4.5). ``dead_experts`` get a
    router bias of -60 so that no token ever routes to them."""
    g = torch.Generator().manual_seed(seed)
    w = Weights(
        router_w=torch.randn(num_experts, hidden, generator=g) * (2.0 / hidden ** 0.5),
        router_b=torch.randn(num_experts, generator=g),
        w13=torch.randn(num_experts, hidden, 2 * inter, generator=g) * (4.0 / hidden ** 0.5),
        b13=torch.randn(num_experts, 2 * inter, generator=g),
        w2=torch.randn(num_experts, inter, hidden, generator=g) * (1.0 / inter ** 0.5),
        b2=torch.randn(num_experts, hidden, generator=g),
    )
    for e in dead_experts:
        w.router_b[e] = -60.0
    return w


def make_tokens(w, num_tokens, seed, dtype=torch.float32, min_gap=0.0):
    """``(num_tokens, H)`` inputs (values exactly representable in ``dtype``), as float32. With ``min_gap`` > 0, rows
    whose 4th/5th largest router logit are closer than ``min_gap`` are redrawn (routing near-ties)."""
    g = torch.Generator().manual_seed(seed)
    e, h, _ = w.dims
    x = torch.randn(num_tokens, h, generator=g).to(dtype).float()
    for _ in range(100):
        if min_gap <= 0 or e <= TOP_K:
            break
        logits = x @ w.router_w.to(dtype).float().T + w.router_b.to(dtype).float()
        top = logits.topk(TOP_K + 1, dim=-1).values
        bad = (top[:, TOP_K - 1] - top[:, TOP_K]) < min_gap
        if not bad.any():
            break
        x[bad] = torch.randn(int(bad.sum()), h, generator=g).to(dtype).float()
    return x


def hf_mlp(w, dtype=torch.float32):
    """transformers' ``GptOssMLP`` holding ``w`` (cast to ``dtype``)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    e, h, i = w.dims
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=TOP_K,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, vocab_size=512)
    mlp = GptOssMLP(cfg)
    with torch.no_grad():
        mlp.router.weight.copy_(w.router_w)
        mlp.router.bias.copy_(w.router_b)
        mlp.experts.gate_up_proj.copy_(w.w13)
        mlp.experts.gate_up_proj_bias.copy_(w.b13)
        mlp.experts.down_proj.copy_(w.w2)
        mlp.experts.down_proj_bias.copy_(w.b2)
    return mlp.to(dtype).eval()


def reference(w, x, dtype=torch.float32):
    """transformers' GPT-OSS MLP output for tokens ``x`` ``(T, H)`` (computed in ``dtype``), as float32."""
    with torch.no_grad():
        out, _ = hf_mlp(w, dtype)(x.to(dtype)[None])
    return out[0].float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (float32)."""
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------------------------------------------------
# where the MoE code lives in the cell's release (read from gptoss_patch.matrix, not from version checks)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEModules:
    """The vllm-ascend MoE modules of one layout family, imported.

    Attributes:
        layout: the :data:`gptoss_patch.matrix.LAYOUTS` key ("B", "C", "E", "F").
        fused_moe: module defining ``AscendUnquantizedFusedMoEMethod`` (0.11.x ``ops.common_fused_moe``, 0.12.0rc1+
            ``ops.fused_moe.fused_moe``).
        comm: ``...moe_comm_method`` (``MoECommMethod`` and its implementations; imports ``unified_apply_mlp`` by
            value).
        mlp: ``...moe_mlp`` (``unified_apply_mlp``).
        selector: ``...experts_selector`` (``select_experts``).
        apply_mlp_patch: the name of our ``unified_apply_mlp`` patch in this layout (``moe.apply_mlp`` or
            ``moe.apply_mlp_012``).
    """

    layout: str
    fused_moe: Any
    comm: Any
    mlp: Any
    selector: Any
    apply_mlp_patch: str

    @property
    def method_cls(self) -> Any:
        """``AscendUnquantizedFusedMoEMethod`` of this release."""
        return self.fused_moe.AscendUnquantizedFusedMoEMethod


def moe_modules(layout: str) -> MoEModules:
    """Import and return the MoE modules of ``layout`` from the targets of :data:`gptoss_patch.matrix.LAYOUTS`.

    Raises:
        KeyError: ``layout`` is not a layout of the matrix, or lacks an MoE target.
    """
    import importlib

    from gptoss_patch import matrix

    from gptoss_patch.patches import layout_plan

    targets = matrix.LAYOUTS[layout]
    apply_mlp, mlp_target = next((spec.name, target) for spec, target in layout_plan(layout)
                                 if spec.name.startswith("moe.apply_mlp"))
    fused_moe = importlib.import_module(targets["moe_unquant_apply"].partition(":")[0])
    comm = importlib.import_module(targets["moe_comm_method_module"])
    mlp = importlib.import_module(mlp_target.partition(":")[0])
    selector = importlib.import_module(comm.__name__.rpartition(".")[0] + ".experts_selector")
    return MoEModules(layout, fused_moe, comm, mlp, selector, apply_mlp)


def routed_out(result: Any) -> torch.Tensor:
    """The routed-expert output of ``MoECommMethod.fused_experts``: the tensor itself (0.11.x ... 0.13.0rc1), or
    ``FusedExpertsResult.routed_out`` (0.13.0rc2+)."""
    return result if isinstance(result, torch.Tensor) else result.routed_out


#: MoE communication types of each layout family (``vllm_ascend.ascend_forward_context.MoECommType`` members, read from
#: the wheels; tests/cell/test_moe.py checks this against the installed enum).
COMM_TYPES: dict[str, tuple[str, ...]] = {
    "B": ("ALLGATHER", "MC2", "ALLTOALL", "NAIVE_MULTICAST"),
    "C": ("ALLGATHER", "MC2", "ALLTOALL", "FUSED_ALLTOALL"),
    "E": ("ALLGATHER", "MC2", "ALLTOALL", "FUSED_MC2"),
    "F": ("ALLGATHER", "MC2", "ALLTOALL", "FUSED_MC2"),
}

#: The communication types whose ``MoECommMethod`` subclass overrides ``fused_experts`` with a fused kernel
#: (``torch.ops._C_ascend.dispatch_ffn_combine`` / ``dispatch_gmm_combine_decode``: no activation, no biases); the
#: runner picks them only for ``w8a8_dynamic`` checkpoints on A3 (0.12.0rc1 ``_select_moe_comm_method``, 0.13.0+
#: ``select_moe_comm_method``).
FUSED_COMM_TYPES: dict[str, tuple[str, ...]] = {"B": (), "C": ("FUSED_ALLTOALL",), "E": ("FUSED_MC2",),
                                                 "F": ("FUSED_MC2",)}


def _runner_method(module_name: str, class_name: str, method: str) -> Any:
    """``class_name.method`` of ``module_name`` compiled from the wheel's source *without importing that module*.

    For ``vllm_ascend.worker.model_runner_v1``, whose import needs ``numba`` (vLLM's n-gram proposer), which the cell
    venvs do not install: the function's own source (``ast``) is compiled in a namespace holding only the names it
    uses, imported the way the module's top-level ``from X import Y`` statements import them. The code that runs is
    upstream's, unchanged.

    Raises:
        LookupError: the method is not defined in the module's source, or uses a name no top-level import provides.
    """
    import __future__
    import ast
    import importlib

    from gptoss_patch.fingerprint import module_source_path

    path = module_source_path(module_name)
    if path is None:
        raise LookupError(f"{module_name} not found")
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    func = next((n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef) and n.name == method), None)
    if func is None:
        raise LookupError(f"{module_name}:{class_name}.{method} is not defined in {path}")
    used = {n.id for n in ast.walk(func) if isinstance(n, ast.Name)}
    namespace: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                bound = alias.asname or alias.name
                if bound in used and bound not in namespace:
                    namespace[bound] = getattr(importlib.import_module(node.module), alias.name)
    func.decorator_list = []
    code = compile(ast.Module(body=[func], type_ignores=[]), path, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    import builtins

    local = {a.arg for a in ast.walk(func) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    missing = sorted(used - set(namespace) - set(dir(builtins)) - local)
    if missing:
        raise LookupError(f"{class_name}.{method} uses names without a top-level import: {missing}")
    exec(code, namespace)  # noqa: S102 - upstream's own method source, see docstring
    return namespace[method]


def select_moe_comm_type(vllm_config: Any, num_tokens: int, with_prefill: bool = True) -> Any:
    """The ``MoECommType`` the running release's model runner picks for a step of ``num_tokens`` tokens.

    * 0.13.0+: ``vllm_ascend.ascend_forward_context.select_moe_comm_method`` (via
      :func:`gptoss_patch.selftest.worker.select_moe_comm_type`);
    * 0.12.0rc1: ``NPUModelRunner._select_moe_comm_method`` itself (:func:`_runner_method`), after
      ``set_mc2_tokens_capacity`` as ``NPUModelRunner.__init__`` calls it (``max_num_seqs``, decode query length 1);
    * 0.11.x: :func:`gptoss_patch.selftest.worker.select_moe_comm_type` (its restatement of the 0.11 rules).
    """
    import types

    import vllm_ascend.ascend_forward_context as afc

    from gptoss_patch.selftest import worker as vllm_setup

    if hasattr(afc, "select_moe_comm_method") or hasattr(afc.MoECommType, "NAIVE_MULTICAST"):
        return vllm_setup.select_moe_comm_type(vllm_config, num_tokens, with_prefill)
    if afc.get_mc2_tokens_capacity() is None:
        spec = vllm_config.speculative_config
        afc.set_mc2_tokens_capacity(vllm_config, vllm_config.scheduler_config.max_num_seqs,
                                    1 + (spec.num_speculative_tokens if spec else 0))
    select = _runner_method("vllm_ascend.worker.model_runner_v1", "NPUModelRunner", "_select_moe_comm_method")
    runner = types.SimpleNamespace(vllm_config=vllm_config, parallel_config=vllm_config.parallel_config)
    return select(runner, num_tokens)


def set_default_torch_dtype(dtype: torch.dtype) -> Any:
    """vLLM's ``set_default_torch_dtype(dtype)`` context manager (``vllm.model_executor.model_loader.utils`` in 0.11,
    ``vllm.utils.torch_utils`` from 0.12), as its model loader uses it around model construction."""
    try:
        from vllm.utils.torch_utils import set_default_torch_dtype as impl
    except ImportError:
        from vllm.model_executor.model_loader.utils import set_default_torch_dtype as impl
    return impl(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# one MoE layer as vLLM's gpt_oss.py builds it, run in vllm-ascend's forward context (patched layouts B, C, E, F)
# ----------------------------------------------------------------------------------------------------------------------

_names = itertools.count()


def fp32_nz_off(dtype):
    """``VLLM_ASCEND_ENABLE_NZ=0`` while a float32 layer is processed on a release that decides MoE NZ with
    ``is_enable_nz`` (0.11.x, 0.12.0rc1), which casts float32 experts whenever it casts bf16 ones - by default on
    0.12.0rc1 - and the grouped matmul rejects float32 NZ weights whatever their shape (0.13.0+'s ``maybe_trans_nz``
    keeps float32 in ND). Elsewhere a no-op."""
    import vllm_ascend.utils as vu

    if dtype != torch.float32 or not hasattr(vu, "is_enable_nz"):
        return contextlib.nullcontext()
    return env_var("VLLM_ASCEND_ENABLE_NZ", "0")


@contextlib.contextmanager
def env_var(name, value):
    """``os.environ[name] = value`` for the duration (``None``: unset)."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def build_layer(cfg, w, dtype, *, tp_rank=0, tp_size=1, activation="swigluoai", has_bias=True, release_nz=False):
    """The MoE layer as vLLM's ``gpt_oss.py`` builds it (``FusedMoE(...)`` with ``MLPBlock``'s arguments), holding
    tensor-parallel rank ``tp_rank`` of ``tp_size``'s weights, loaded the way vLLM 0.11.0's
    ``GptOssModel._load_weights_other`` loads them without expert parallelism (column range ``2*start:2*end`` of the
    interleaved ``gate_up_proj``, row range of ``down_proj``, ``w2_bias`` only on rank 0), then
    ``process_weights_after_loading``. ``tp_size > 1`` builds that rank's layer in this single-process world (the
    per-rank shapes; the all-reduce is done by the caller). Float32 layers get :func:`fp32_nz_off` unless
    ``release_nz``. The parameters are made in NPU memory (vLLM's ``get_model`` builds the model under
    ``with torch.device(load_device)``) and the host weights copied in, as the weight loader does."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    from gptoss_patch.selftest import worker as vllm_setup

    e, h, i = w.dims
    per_rank = i // tp_size
    start, end = tp_rank * per_rank, (tp_rank + 1) * per_rank
    with vllm_setup.ascend_context(vllm_config=cfg), set_default_torch_dtype(dtype), torch.device("npu"):
        layer = FusedMoE(num_experts=e, top_k=TOP_K, hidden_size=h, intermediate_size=per_rank, reduce_results=True,
                         renormalize=True, quant_config=None, prefix=f"gptoss_moe_case.{next(_names)}.experts",
                         apply_router_weight_on_input=False, has_bias=has_bias, activation=activation,
                         is_sequence_parallel=False)
        with torch.no_grad():
            layer.w13_weight.copy_(w.w13[:, :, 2 * start:2 * end].permute(0, 2, 1))
            layer.w2_weight.copy_(w.w2[:, start:end, :].permute(0, 2, 1))
            if has_bias:
                layer.w13_bias.copy_(w.b13[:, 2 * start:2 * end])
                layer.w2_bias.copy_(w.b2 if tp_rank == 0 else torch.zeros_like(w.b2))
        with (contextlib.nullcontext() if release_nz else fp32_nz_off(dtype)):
            layer.quant_method.process_weights_after_loading(layer)
    return layer


def run_layer(cfg, layer, w, x, *, moe_comm_type=None, with_prefill=True):
    """Router ``Linear`` (in the layer's dtype, as ``MLPBlock.router``) then the MoE layer, in vllm-ascend's forward
    context for ``len(x)`` tokens, with the communication method the release's runner picks (or ``moe_comm_type``).
    The MoE communication methods are process-global in vllm-ascend (set up by the last ``AscendFusedMoE`` built), so
    they are set up for this layer first. ``x`` ``[T, H]`` (any float dtype, on the host or the NPU; cast to the
    layer's and placed on the NPU, with the router's weights); returns ``[T, H]`` in the layer's dtype, in NPU
    memory."""
    from gptoss_patch.selftest import worker as vllm_setup
    from gptoss_patch.selftest.attention import installed_layout

    comm = moe_modules(installed_layout()).comm
    dtype = layer.w13_weight.dtype
    xd = x.to("npu", dtype)
    with vllm_setup.ascend_context(vllm_config=cfg), torch.no_grad():
        comm.setup_moe_comm_method(layer.moe_config)
        if moe_comm_type is None:
            moe_comm_type = select_moe_comm_type(cfg, xd.shape[0], with_prefill)
        logits = torch.nn.functional.linear(xd, w.router_w.to("npu", dtype), w.router_b.to("npu", dtype))
        with vllm_setup.forward_context(cfg, xd.shape[0], with_prefill=with_prefill, moe_comm_type=moe_comm_type):
            return layer(hidden_states=xd, router_logits=logits)
