"""The version matrix: one declarative table of upstream releases, and :func:`decide`.

Every fact here was read from the released wheels (``pip download --no-deps vllm-ascend==X``) and
from ``docs/upstream.md`` §1 (pairing, torch-npu pins, CANN) and §2 (where each
target lives); a row is ``tested`` only when a ``nox`` cell ``cell-<release>`` runs the suite
against that release's real wheels.

Verdicts are per GPT-OSS *capability* (:data:`CAPABILITIES`), not only per release: in each row every
capability is *native* (upstream computes it right), *patched* (by us, with the patches of the row's layout),
*deviates* (native, with a documented numerical deviation that ``verify`` warns about) or *refused* (wrong
upstream and not patched: building a GPT-OSS model that would use it stops with the reason and the setting
that avoids it). The release verdict follows from them:

* ``apply``: some capability is patched; the patches of the row's layout are registered, the guard is armed.
  (``checkpoint_mxfp4`` is the exception: its patches are vLLM-side, :data:`MXFP4_TARGETS`, and are registered on
  *apply* and *stand-down* rows alike when the row says *patched*.)
* ``stand-down``: nothing to patch; the guard is still armed and refuses the row's *refused* capabilities
  when the model being built would use them (e.g. FULL_DECODE_ONLY graphs on 0.15.0rc1-0.19.1rc1).
* ``refuse``: unknown, unparsable, unpaired or structurally different; nothing is patched, and building a
  GPT-OSS model stops with an error (the guard), so a server never emits garbage.

A build that is not a row (a pre-release or local build such as ``0.11.0rc1.dev449+gc9b64052e``,
or a vLLM that is not the paired one) maps to the nearest tested *apply* row of the same ``major.minor``
series, but only when every target passes the structural check for that row's layout; the
reason then says "untested build, structurally compatible with X". ``GPTOSS_PATCH_FORCE=1``
applies the nearest row anyway (loudly). A *local version label* (``0.11.0+empty`` in the official images,
``+cpu``, ``+ascend...``) is the public release it labels: versions are matched on
:attr:`packaging.version.Version.public`. A release newer than the newest row is refused: nobody has checked it.
Adding a release: ``docs/adding-a-release.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from packaging.version import InvalidVersion, Version

APPLY = "apply"
STAND_DOWN = "stand-down"
REFUSE = "refuse"
#: The decision when ``GPTOSS_PATCH_DISABLE=1``: nothing is patched, the guard stays armed.
DISABLED = "disabled"

# ---------------------------------------------------------------------------------------------
# Where each patch target lives, per module-layout family (docs/upstream.md §2).
# A "target key" names a place our patches hook; the value is "module:qualname".
# ---------------------------------------------------------------------------------------------

_AA = "vllm_ascend.attention.attention_v1"
_AG = "vllm_ascend.compilation.acl_graph"
_MR = "vllm_ascend.worker.model_runner_v1"
_FM = "vllm_ascend.ops.fused_moe"  # 0.12.0rc1+ (ops/moe -> ops/fused_moe, docs/upstream.md §7.4)
_YARN = "vllm_ascend.ops.rotary_embedding:AscendYaRNRotaryEmbedding.__init__"

#: Targets shared by every layout from 0.12.0rc1 on (vLLM's opaque attention op calls ``impl.forward``, which
#: writes the KV cache and calls ``forward_impl``; MoE lives in ``ops/fused_moe``). One entry per line: each
#: capability module owns its own keys.
_FROM_012: dict[str, str] = {
    "attention_impl_init": f"{_AA}:AscendAttentionBackendImpl.__init__",
    "attention_impl_forward_impl": f"{_AA}:AscendAttentionBackendImpl.forward_impl",
    "yarn_rope_init": _YARN,
    "moe_unquant_apply": f"{_FM}.fused_moe:AscendUnquantizedFusedMoEMethod.apply",
    "moe_fused_experts": f"{_FM}.moe_comm_method:MoECommMethod.fused_experts",
    "moe_unified_apply_mlp_012": f"{_FM}.moe_mlp:unified_apply_mlp",
    "moe_comm_method_module": f"{_FM}.moe_comm_method",  # imports unified_apply_mlp by value
    "moe_unquant_process_weights": f"{_FM}.fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
    "model_runner_module": _MR,
}

LAYOUTS: dict[str, dict[str, str]] = {
    # B = vllm-ascend 0.11.0rc1, rc2, rc3, 0.11.0 (identical module layout; docs/upstream.md §2)
    "B": {
        "attention_impl_init": f"{_AA}:AscendAttentionBackendImpl.__init__",
        "attention_impl_forward_011": f"{_AA}:AscendAttentionBackendImpl.forward",
        "yarn_rope_init": _YARN,
        "moe_unquant_apply": "vllm_ascend.ops.common_fused_moe:AscendUnquantizedFusedMoEMethod.apply",
        "moe_fused_experts": "vllm_ascend.ops.moe.moe_comm_method:MoECommMethod.fused_experts",
        "moe_unified_apply_mlp_011": "vllm_ascend.ops.moe.moe_mlp:unified_apply_mlp",
        "moe_comm_method_module": "vllm_ascend.ops.moe.moe_comm_method",  # imports unified_apply_mlp by value
        "moe_unquant_process_weights": (
            "vllm_ascend.ops.common_fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading"),
        "aclgraph_update_attn_params": f"{_AG}:update_attn_params",
        "model_runner_module": _MR,  # imports update_attn_params by value
    },
    # C = vllm-ascend 0.12.0rc1: forward_impl dispatch, full_graph_attention, update_attn_params(3 args)
    "C": {
        **_FROM_012,
        "aclgraph_update_attn_params": f"{_AG}:update_attn_params",
    },
    # E = 0.13.0rc2 ... 0.13.0 (0.13.0rc1, family D, differs only in signatures our patches accept: it is
    # judged against E by the structural check): FIA/PA split, update_attn_params(..., vllm_config[, draft])
    "E": {
        **_FROM_012,
        "aclgraph_update_attn_params_013": f"{_AG}:update_attn_params",
        "aclgraph_eagle_proposer_module": "vllm_ascend.spec_decode.eagle_proposer",  # 0.13.0 imports it by value
    },
    # F = 0.14.0rc1: update_full_graph_params -> AscendAttentionBackendImpl.update_graph_params (staticmethod)
    "F": {
        **_FROM_012,
        "aclgraph_update_graph_params": f"{_AA}:AscendAttentionBackendImpl.update_graph_params",
    },
    # H = 0.15.0rc1, 0.16.0rc1: native GPT-OSS (sinks taken by __init__), but the sliding layers' fused call passes
    # swa_mask with sparse_mode 4 and admits 129 keys (docs/upstream.md §4.3, §4.4); forward_impl as in 0.12-0.14
    # FULL_DECODE_ONLY: update_full_graph_params calls the staticmethod update_graph_params as on 0.14.0rc1 (F)
    "H": {
        "attention_impl_forward_impl": f"{_AA}:AscendAttentionBackendImpl.forward_impl",
        "aclgraph_update_graph_params": f"{_AA}:AscendAttentionBackendImpl.update_graph_params",
    },
    # G = 0.17.0rc1, 0.18.0rc1, 0.18.0: layout H, and the MoE activation string compare is wrong with vLLM >= 0.17's
    # MoEActivation Enum (unified_apply_mlp calls unquant_apply_mlp through the module global)
    "G": {
        "attention_impl_forward_impl": f"{_AA}:AscendAttentionBackendImpl.forward_impl",
        "aclgraph_update_graph_params": f"{_AA}:AscendAttentionBackendImpl.update_graph_params",
        "moe_unquant_apply_mlp": f"{_FM}.moe_mlp:unquant_apply_mlp",
    },
    # I = 0.19.1rc1: upstream's sink path with the template mask (PR #8387), pre_tokens = the window (129 keys;
    # docs/upstream.md §4.3): the impl's window is turned into pre_tokens where it is built; FULL_DECODE_ONLY captures
    # every layer with full_graph_fia (FIA v1, no sinks; §4.2), updated by the staticmethod update_graph_params
    "I": {
        "attention_impl_init": f"{_AA}:AscendAttentionBackendImpl.__init__",
        "attention_impl_full_graph_fia": f"{_AA}:AscendAttentionBackendImpl.full_graph_fia",
        "aclgraph_update_graph_params": f"{_AA}:AscendAttentionBackendImpl.update_graph_params",
    },
    # J = 0.20.2rc1 ... 0.30.0rc2: layout I's band; the graphs capture sink layers with full_graph_fia_v2 (PR #9165)
    "J": {
        "attention_impl_init": f"{_AA}:AscendAttentionBackendImpl.__init__",
    },
}

#: The vLLM side of the pairing: the vLLM code every GPT-OSS fix relies on, as ``key -> (locations, parameters)``.
#: ``locations`` are the ``module:qualname`` candidates (vLLM moved ``Attention`` from ``vllm.attention.layer``
#: to ``vllm.model_executor.layers.attention.attention`` in 0.16.0); the first that exists is checked for
#: ``parameters`` (``"**"``: accepts ``**kwargs``). A vLLM that is not a row's paired release is applied only when
#: every entry passes, as for the vllm-ascend targets (:func:`gptoss_patch.pairing.structural_check`).
VLLM_RELIED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # the guard's target; vllm_config is what refused_in_use reads
    "gpt_oss_model_init": (("vllm.model_executor.models.gpt_oss:GptOssForCausalLM.__init__",), ("vllm_config",)),
    # passes sinks= and per_layer_sliding_window= to Attention
    "gpt_oss_attention_init": (("vllm.model_executor.models.gpt_oss:OAIAttention.__init__",), ()),
    # the BF16 loader (w2_bias only on TP rank 0: the bias is added once after the all-reduce)
    "gpt_oss_load_weights_other": (("vllm.model_executor.models.gpt_oss:GptOssModel._load_weights_other",), ()),
    # FusedMoE(activation="swigluoai", has_bias=True)
    "fused_moe_init": (("vllm.model_executor.layers.fused_moe.layer:FusedMoE.__init__",), ("activation", "has_bias")),
    # sinks reach the impl through **extra_impl_args; the window through per_layer_sliding_window
    "attention_init": (("vllm.attention.layer:Attention.__init__",
                        "vllm.model_executor.layers.attention.attention:Attention.__init__"),
                       ("per_layer_sliding_window", "**")),
}

#: Where the MXFP4 checkpoint patches (:mod:`gptoss_patch.patches.checkpoint_mxfp4`) hook: vLLM-side targets, the same in every
#: vLLM paired with a row whose ``checkpoint_mxfp4`` capability is *patched* (vLLM 0.11.0 ... 0.19.1, read from each
#: release's ``vllm/config/model.py`` and ``vllm/model_executor/models/gpt_oss.py``; docs/upstream.md). They are
#: registered on *apply* and *stand-down* rows alike, whatever the row's layout.
MXFP4_TARGETS: dict[str, str] = {
    "mxfp4_verify_quantization": "vllm.config.model:ModelConfig._verify_quantization",
    "mxfp4_load_weights": "vllm.model_executor.models.gpt_oss:GptOssModel.load_weights",
    "mxfp4_causal_lm_load_weights": "vllm.model_executor.models.gpt_oss:GptOssForCausalLM.load_weights",
}

#: Which patches (by name, see gptoss_patch.patches) each layout family needs. One name per line: each
#: capability module owns its own lines.
LAYOUT_PATCHES: dict[str, tuple[str, ...]] = {
    "B": (
        "attention.keep_sinks",
        "attention.sink_window_forward",
        "yarn.truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp",
        "attention_graph.update_attn_params",
        "nz_padding.pad_moe_intermediate",
    ),
    "C": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "yarn.truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "attention_graph.update_attn_params",
        "nz_padding.pad_moe_intermediate",
    ),
    "E": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "yarn.truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "attention_graph.update_attn_params_013",
        "nz_padding.pad_moe_intermediate",
    ),
    "F": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "yarn.truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "attention_graph.update_graph_params",
        "nz_padding.pad_moe_intermediate",
    ),
    "H": (
        "attention.sink_window_forward_impl",
        "attention_graph.update_graph_params",
    ),
    "G": (
        "attention.sink_window_forward_impl",
        "attention_graph.update_graph_params",
        "moe.activation_name",
    ),
    "I": (
        "attention.band_128_keys",
        "attention_graph.capture_sinks",
        "attention_graph.update_graph_params",
    ),
    "J": (
        "attention.band_128_keys",
    ),
}


# ---------------------------------------------------------------------------------------------
# GPT-OSS capabilities and their state per release
# ---------------------------------------------------------------------------------------------

#: Every GPT-OSS capability a release is judged on, with the text ``verify`` shows.
CAPABILITIES: dict[str, str] = {
    "attention": "attention sinks + alternating 128-token sliding window (eager and PIECEWISE graphs)",
    "attention_graph": "the same attention under FULL_DECODE_ONLY ACL graphs (capture + per-step update)",
    "moe": "swigluoai experts with both expert biases (unquantized MoE)",
    "quantized_moe": "quantized GPT-OSS experts (W8A8 and other vllm-ascend quantization methods)",
    "nz_padding": "per-rank MoE intermediate 360 (120b at TP 8) on FRACTAL_NZ weights",
    "yarn": "YaRN rope with rope_scaling.truncate = false",
    "checkpoint_bf16": "loading a BF16 GPT-OSS checkpoint",
    "checkpoint_mxfp4": "loading an official MXFP4 GPT-OSS checkpoint (experts dequantized to BF16 while loading)",
    "atlas_310p": "Atlas 300I Duo (310P) attention",
    "paged_attention_shapes": "additional_config.pa_shape_list under FULL_DECODE_ONLY graphs",
    "context_parallel": "attention under prefill / decode context parallelism (--prefill-context-parallel-size, "
                        "--decode-context-parallel-size > 1)",
    "structured_outputs": "structured outputs (json_schema, tool_choice required / named) batched with plain requests",
    "model_runner_v2": "GPT-OSS under vllm-ascend's model runner v2 (VLLM_USE_V2_MODEL_RUNNER=1)",
}

NATIVE = "native"
PATCHED = "patched"
DEVIATES = "deviates"
REFUSED = "refused"


@dataclass(frozen=True)
class Cap:
    """The state of one GPT-OSS capability in one release.

    Attributes:
        state: ``native`` / ``patched`` / ``deviates`` / ``refused``.
        note: why (upstream file, PR or issue); for ``refused``, also what avoids it.
    """

    state: str
    note: str = ""


#: Shared capability texts (each names its evidence; docs/upstream.md has the details per release).
_C_QUANT = Cap(REFUSED, "vllm-ascend's quantized MoE paths drop the expert biases (every release up to 0.30.0rc2) "
                        "and have no swigluoai before 0.28.0rc1; use a BF16 checkpoint")
_C_310P = Cap(REFUSED, "no vllm-ascend release passes GPT-OSS's sinks to the 310P attention "
                       "(vllm_ascend/_310p); use an Atlas A2/A3 (910B/910C) card")
_C_GRAPH_NATIVE_BUG = Cap(REFUSED, "FULL_DECODE_ONLY capture of GPT-OSS attention drops the sinks and the window "
                                   "(full_graph_fia: FIA v1, sparse_mode 3; "
                                   "fixed upstream by PR #9165 in 0.20.2rc1); serve with "
                                   "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or upgrade")
_C_BAND = Cap(PATCHED, "sliding layers take the TND band with sparse_mode 4 and pre_tokens = 128: 129 keys "
                       "where GPT-OSS attends 128 (docs/operators.md, calibration finding 2; every release up to "
                       "0.30.0rc2); GPT-OSS's sliding impls are built with pre_tokens 127 (layouts I, J)")
#: vllm-ascend 0.15.0rc1 - 0.18.0 (layouts H, G): upstream's sliding layers are wrong twice; we route the layers with
#: sinks or a window to the same fused call as on 0.12-0.14 (gptoss_patch.patches.attention ``_forward_impl``).
#: vllm-ascend 0.15.0rc1 - 0.18.0 (layouts H, G): under FULL_DECODE_ONLY the layers with sinks or a window run our call
#: (its capture is the one of 0.11-0.14), and the graph update re-issues it with each step's lengths.
_C_GRAPH_PATCHED_015 = Cap(PATCHED, "upstream's FULL_DECODE_ONLY capture drops the sinks and the window "
                                    "(full_graph_fia: FIA v1, sparse_mode 3; fixed by PR #9165 in 0.20.2rc1); the "
                                    "sink and window layers are captured by our call and updated per step "
                                    "(update_graph_params)")
#: vllm-ascend 0.19.1rc1 (layout I): upstream's forward captures every layer with full_graph_fia; sink layers are
#: captured by our call there instead.
_C_GRAPH_PATCHED_019 = Cap(PATCHED, "upstream's FULL_DECODE_ONLY capture (full_graph_fia: FIA v1, sparse_mode 3) drops "
                                    "the sinks and the window (fixed by PR #9165 in 0.20.2rc1); sink layers are "
                                    "captured by our call there and updated per step (update_graph_params)")
_C_SWA_PATCHED = Cap(PATCHED, "upstream's sliding layers pass swa_mask with sparse_mode 4 (not the template mask the "
                              "operator requires; fixed by PR #8387 in 0.19.1rc1) and admit 129 keys; layers with "
                              "sinks or a window run our fused call: template mask, 128-key band")
_C_PA_SHAPES = Cap(REFUSED, "with additional_config.pa_shape_list, FULL_DECODE_ONLY decode batches of those sizes run "
                            "GPT-OSS's full-attention layers through _npu_paged_attention, which has no sinks "
                            "(forward_impl checks the window, not the sinks; every release up to 0.30.0rc2); "
                            "remove pa_shape_list")
#: Context parallelism (docs/upstream.md §4.13): with prefill or decode context parallelism (pcp / dcp > 1)
#: vllm-ascend's attention backend hands out its context-parallel impl (``attention_v1.py`` ``get_impl_cls``), which
#: never mentions sinks; vLLM's own check (``check_attention_cp_compatibility``) asks for the LSE only.
_C_CP = Cap(REFUSED, "with pcp or dcp > 1 the layers run AscendAttentionCPImpl, whose own forward_impl has no sinks "
                     "(attention_cp.py, 0.12.0rc1-0.24.0rc1); serve without --prefill-context-parallel-size / "
                     "--decode-context-parallel-size")
_C_CP_025 = Cap(REFUSED, "with dcp > 1 the layers run AscendAttentionDCPImpl, whose own forward_impl has no sinks; "
                         "the PCP paths of the main impl were not checked against sinks (0.25.1rc1-0.30.0rc2); serve "
                         "without --prefill-context-parallel-size / --decode-context-parallel-size")
_C_CP_011 = Cap(REFUSED, "vllm-ascend 0.11 has no context-parallel attention for GPT-OSS's layers; serve without "
                         "--decode-context-parallel-size")
_C_GRAPH_NATIVE = Cap(NATIVE, "captured with learnable_sink since PR #9165 (full_graph_fia_v2)")
_C_BF16_024 = Cap(REFUSED, "vLLM 0.24.0 keeps experts under routed_experts without the BF16 name remap (vLLM #45818, "
                           "first in 0.25.1) and vllm-ascend 0.24.0rc1 dropped its alias: a BF16 GPT-OSS checkpoint "
                           "does not load (vllm#45830); use vllm-ascend 0.23.0 or 0.25.1rc1")


#: MXFP4 checkpoints (docs/upstream.md "MXFP4 checkpoints"): no vllm-ascend release runs FP4 experts; vLLM's
#: ``NPUPlatform.verify_quantization`` rejects ``mxfp4``. Patched (dequantized to BF16 per rank while loading) where the
#: vLLM side was read and a cell runs the MXFP4 checkpoint; refused (loud at start-up) where nobody checked the loader.
_C_MXFP4 = Cap(PATCHED, "no vllm-ascend release runs MXFP4 experts (vLLM's quantization check rejects mxfp4 on NPU); "
                        "the experts are dequantized to BF16 per rank slice while vLLM's BF16 loader reads them")
_C_MXFP4_UNCHECKED = Cap(REFUSED, "MXFP4 dequantization not checked against this release's vLLM GPT-OSS loader "
                                  "(vLLM >= 0.20); use a BF16 checkpoint or vllm-ascend <= 0.19.1rc1")


#: vLLM 0.11.0's BF16 loader passes the expert-parallel range swapped (gptoss_patch.patches.checkpoint_bf16).
_C_BF16_EP_011 = Cap(PATCHED, "vLLM 0.11.0's GptOssModel.load_weights calls _load_weights_other(ep_rank_end, "
                              "ep_rank_start) against its (ep_rank_start, ep_rank_end) signature: with "
                              "--enable-expert-parallel every expert slice is empty and loading fails; the range is "
                              "put back in order (vLLM 0.12.0 fixed the signature)")


#: Structured outputs (gptoss_patch.patches.structured_outputs): how each release hands xgrammar's CPU kernel the rows
#: of a mixed batch (read from vllm_ascend/worker/model_runner_v1.py and vllm/v1/structured_output/utils.py).
_C_SO_OWN = Cap(NATIVE, "vllm-ascend applies the bitmask with its own apply_grammar_bitmask and a list of indices")
_C_SO_TENSOR = Cap(PATCHED, "the runner calls vLLM's apply_grammar_bitmask, which passes a tensor of indices; vLLM "
                            "0.13 pins xgrammar 0.1.27, whose CPU kernel takes a list: a constrained request batched "
                            "with plain ones killed the engine (vllm-ascend #6820); GPT-OSS's indices are handed on as "
                            "a list (xgrammar 0.1.30's change); other models: pip install \"xgrammar>=0.1.30\"")
_C_SO_PIN = Cap(NATIVE, "vLLM's apply_grammar_bitmask passes a tensor of indices; vllm-ascend requires "
                        "xgrammar>=0.1.30, which takes it (PR #6151; verify warns about an older one)")


#: Model runner v2 (``vllm_ascend/worker/v2``, from 0.13.0rc1; selected by ``VLLM_USE_V2_MODEL_RUNNER=1``, off by
#: default in every release, read by vllm-ascend's worker directly; docs/upstream.md §4.14).
_C_MRV2 = Cap(REFUSED, "model runner v2 (vllm_ascend/worker/v2) was not checked with GPT-OSS here: gptoss-patch hooks "
                       "the v1 runner's attention, graph and MoE paths, the forward context and backend name follow "
                       "the variable, and the v2 runner never sets the sinks flag that the graph update reads (0.20.2rc1 "
                       "on); serve without VLLM_USE_V2_MODEL_RUNNER (the default v1 runner)")
_C_NO_MRV2 = Cap(NATIVE, "no model runner v2 in this release: the variable selects nothing")


def _patched_caps(p310: Cap = _C_310P, bf16: Cap = Cap(NATIVE), cp: Cap = _C_CP,
                  so: Cap = _C_SO_OWN, mrv2: Cap = _C_MRV2) -> dict[str, Cap]:
    """Capabilities of an *apply* row of layouts B-F (vllm-ascend 0.11-0.14)."""
    return {
        "attention": Cap(PATCHED, "sinks dropped and the window honoured in one path only upstream"),
        "attention_graph": Cap(PATCHED, "the ACL-graph parameter update knows only the old paged-attention call"),
        "moe": Cap(PATCHED, "swigluoai and the expert biases ignored upstream (vllm-ascend issue #4283)"),
        "quantized_moe": _C_QUANT,
        "nz_padding": Cap(PATCHED, "the NZ cast of a 360-wide w2 is misaligned; padded to 368 where it casts"),
        "yarn": Cap(PATCHED, "vllm-ascend's YaRN rounds the ramp (and rejects truncate= from vLLM >= 0.12)"),
        "checkpoint_bf16": bf16,
        "checkpoint_mxfp4": _C_MXFP4,
        "atlas_310p": p310,
        "paged_attention_shapes": Cap(PATCHED, "sink and window layers take our attention path in every state"),
        "context_parallel": cp,
        "structured_outputs": so,
        "model_runner_v2": mrv2,
    }


def _native_caps(**changes: Cap) -> dict[str, Cap]:
    """Capabilities of a natively supporting row (vllm-ascend >= 0.15.0rc1), with ``changes``."""
    caps = {
        "attention": _C_BAND,
        "attention_graph": _C_GRAPH_NATIVE_BUG,
        "moe": Cap(NATIVE),
        "quantized_moe": _C_QUANT,
        "nz_padding": Cap(NATIVE, "no default NZ cast of unquantized MoE weights on A2/A3"),
        "yarn": Cap(NATIVE),
        "checkpoint_bf16": Cap(NATIVE),
        "checkpoint_mxfp4": _C_MXFP4,
        "atlas_310p": _C_310P,
        "paged_attention_shapes": _C_PA_SHAPES,
        "context_parallel": _C_CP,
        "structured_outputs": _C_SO_PIN,
        "model_runner_v2": _C_MRV2,
    }
    caps.update(changes)
    return caps


#: vLLM >= 0.17 hands FusedMoE's activation on as the plain Enum ``MoEActivation.SWIGLUOAI``
#: (vllm/model_executor/layers/fused_moe/layer.py ``MoEActivation.from_str``); vllm-ascend < 0.19.1rc1
#: compares ``activation == "swigluoai"`` in ``unquant_apply_mlp``: False, so experts run plain SwiGLU.
_C_MOE_ENUM = Cap(PATCHED, "vLLM >= 0.17 passes MoEActivation.SWIGLUOAI, vllm-ascend compares with the string "
                           "\"swigluoai\" and runs plain SwiGLU (vllm-ascend issue #8463, fixed by PR #8465 in "
                           "0.19.1rc1)")


@dataclass(frozen=True)
class Row:
    """One upstream release: what it pairs with and what we do with it.

    Attributes:
        vllm_ascend: the vllm-ascend release (PEP 440 string, e.g. ``"0.11.0"``).
        vllm: the paired vLLM release (vllm-ascend's versioning policy matrix).
        torch / torch_npu: versions pinned by the vllm-ascend wheel's METADATA.
        cann: minimum CANN from the compatibility matrix.
        verdict: ``apply``, ``stand-down`` or ``refuse``.
        layout: key into :data:`LAYOUTS` (``None`` when nothing is patched).
        tested: True when a nox cell runs the suite against this release's wheels.
        note: one line shown by ``verify --matrix``.
        caps: the state of every GPT-OSS capability (:data:`CAPABILITIES` key -> :class:`Cap`); empty for a
            *refuse* row (nothing runs).
    """

    vllm_ascend: str
    vllm: str | None
    torch: str
    torch_npu: str
    cann: str
    verdict: str
    layout: str | None = None
    tested: bool = False
    note: str = ""
    caps: Mapping[str, Cap] = field(default_factory=dict)

    @property
    def version(self) -> Version:
        """The vllm-ascend release as a :class:`packaging.version.Version`."""
        return Version(self.vllm_ascend)


#: The table. Order does not matter; :func:`decide` sorts by version.
ROWS: tuple[Row, ...] = (
    Row("0.11.0rc0", "0.11.0rc3", "2.7.1", "2.7.1.dev20250724", "8.2.RC1", REFUSE, None, False,
        "different architecture (Attention class replaced wholesale, MoE method monkey-patched onto vLLM's)"),
    Row("0.11.0rc1", "0.11.0", "2.7.1", "2.7.1", "8.3.RC1", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)",
        _patched_caps(bf16=_C_BF16_EP_011, cp=_C_CP_011, mrv2=_C_NO_MRV2)),
    Row("0.11.0rc2", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)",
        _patched_caps(bf16=_C_BF16_EP_011, cp=_C_CP_011, mrv2=_C_NO_MRV2)),
    Row("0.11.0rc3", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)",
        _patched_caps(bf16=_C_BF16_EP_011, cp=_C_CP_011, mrv2=_C_NO_MRV2)),
    Row("0.11.0", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", True,
        "GPT-OSS patches applied (see verify for the list)", _patched_caps(bf16=_C_BF16_EP_011, cp=_C_CP_011, mrv2=_C_NO_MRV2)),
    Row("0.12.0rc1", "0.12.0", "2.8.0", "2.8.0", "8.3.RC2", APPLY, "C", True,
        "GPT-OSS patches applied (see verify for the list)", _patched_caps(mrv2=_C_NO_MRV2)),
    Row("0.13.0rc1", "0.13.0", "2.8.0", "2.8.0", "8.3.RC2", APPLY, "E", False,
        "judged against 0.13.0 (every target passes the structural check, read from the wheel)",
        _patched_caps(so=_C_SO_TENSOR)),
    Row("0.13.0rc2", "0.13.0", "2.8.0", "2.8.0", "8.5.0", APPLY, "E", False,
        "judged against 0.13.0 (every target passes the structural check, read from the wheel)",
        _patched_caps(so=_C_SO_TENSOR)),
    Row("0.13.0rc3", "0.13.0", "2.8.0", "2.8.0.post2", "8.5.1", REFUSE, None, False,
        "a separate build released after 0.13.0 (DeepSeek-V4 code; its MoE apply differs from 0.13.0's) "
        "that no cell tests"),
    Row("0.13.0", "0.13.0", "2.8.0", "2.8.0.post2", "8.5.0", APPLY, "E", True,
        "GPT-OSS patches applied (see verify for the list)", _patched_caps(so=_C_SO_TENSOR)),
    Row("0.14.0rc1", "0.14.1", "2.9.0", "2.9.0", "8.5.0", APPLY, "F", True,
        "GPT-OSS patches applied (see verify for the list)",
        _patched_caps(p310=Cap(REFUSED, "the 310P backend is a subclass (vllm_ascend/_310p/attention/attention_v1.py "
                                        "AscendAttentionBackendImpl310) with its own forward_impl and no sinks; "
                                        "use an Atlas A2/A3 (910B/910C) card"), so=_C_SO_PIN)),
    Row("0.15.0rc1", "0.15.0", "2.9.0", "2.9.0", "8.5.0", APPLY, "H", True,
        "native GPT-OSS support (PR #5901); sliding-window attention patched (swa_mask, 129 keys)",
        _native_caps(attention=_C_SWA_PATCHED, attention_graph=_C_GRAPH_PATCHED_015)),
    Row("0.16.0rc1", "0.16.0", "2.9.0", "2.9.0", "8.5.0", APPLY, "H", True,
        "native GPT-OSS support; sliding-window attention patched (swa_mask, 129 keys); vLLM 0.16.0 still passes "
        "the MoE activation as a string",
        _native_caps(attention=_C_SWA_PATCHED, attention_graph=_C_GRAPH_PATCHED_015)),
    Row("0.17.0rc1", "0.17.0", "2.9.0", "2.9.0", "8.5.1", APPLY, "G", True,
        "sliding-window attention patched (swa_mask, 129 keys); MoE activation patched (vLLM 0.17 Enum vs "
        "vllm-ascend string)",
        _native_caps(attention=_C_SWA_PATCHED, attention_graph=_C_GRAPH_PATCHED_015, moe=_C_MOE_ENUM)),
    Row("0.18.0rc1", "0.18.0", "2.9.0", "2.9.0", "8.5.1", APPLY, "G", False,
        "sliding-window attention patched (swa_mask, 129 keys); MoE activation patched (vLLM 0.18 Enum vs "
        "vllm-ascend string)",
        _native_caps(attention=_C_SWA_PATCHED, attention_graph=_C_GRAPH_PATCHED_015, moe=_C_MOE_ENUM)),
    Row("0.18.0", "0.18.0", "2.9.0", "2.9.0", "8.5.1", APPLY, "G", True,
        "sliding-window attention patched (swa_mask, 129 keys); MoE activation patched (vLLM 0.18 Enum vs "
        "vllm-ascend string)",
        _native_caps(attention=_C_SWA_PATCHED, attention_graph=_C_GRAPH_PATCHED_015, moe=_C_MOE_ENUM)),
    Row("0.19.1rc1", "0.19.1", "2.9.0", "2.9.0", "8.5.1", APPLY, "I", True,
        "native GPT-OSS support (MoE activation fixed by PR #8465, swa_mask by PR #8387); sliding window patched "
        "(129 keys); FULL_DECODE_ONLY capture patched", _native_caps(attention_graph=_C_GRAPH_PATCHED_019)),
    *(Row(va, vv, "2.10.0", npu, cann, APPLY, "J", False, f"{note}; sliding window patched (129 keys)",
          _native_caps(**{"attention_graph": _C_GRAPH_NATIVE,
                          "checkpoint_mxfp4": _C_MXFP4_UNCHECKED,
                          "context_parallel": _C_CP_025 if Version(va) >= Version("0.25.1rc1") else _C_CP,
                          **changes}))
      for va, vv, npu, cann, note, changes in (
          ("0.20.2rc1", "0.20.2", "2.10.0", "9.0.0", "native; graphs keep the sinks (PR #9165)", {}),
          ("0.21.0rc1", "0.21.0", "2.10.0", "9.0.0", "native (judged from the wheel: its sdist differs)", {}),
          ("0.22.1rc1", "0.22.1", "2.10.0", "9.0.0", "native", {}),
          ("0.23.0rc1", "0.23.0", "2.10.0.post2", "9.0.1", "native", {}),
          ("0.23.0", "0.23.0", "2.10.0.post4", "9.0.1", "native", {}),
          ("0.23.0.post1", "0.23.0", "2.10.0.post4", "9.1.0", "native (sdist only on PyPI for cp311)", {}),
          ("0.24.0rc1", "0.24.0", "2.10.0.post2", "9.0.1", "BF16 GPT-OSS checkpoints do not load",
           {"checkpoint_bf16": _C_BF16_024}),
          ("0.25.1rc1", "0.25.1", "2.10.0.post2", "9.0.1", "native", {}),
          ("0.26.0rc1", "0.26.0", "2.10.0.post4", "9.1.0", "native", {}),
          ("0.27.1rc1", "0.27.1", "2.10.0.post4", "9.1.0", "native (sdist only on PyPI for cp311)", {}),
          ("0.28.0rc1", "0.28.0", "2.10.0.post4", "9.1.0", "native (sdist only; quantized MoE: activation handled, "
                                                         "expert biases still dropped)", {}),
          ("0.29.0rc1", "0.29.0", "2.10.0.post4", "9.1.0", "native (sdist only; BF16 loader restructured)", {}),
          ("0.30.0rc1", "0.30.0", "2.10.0.post4", "9.2.0", "native (sdist only)", {}),
          ("0.30.0rc2", "0.30.0", "2.10.0.post4", "9.2.0", "native (sdist only)", {}),
      )),
)

#: From this vllm-ascend release on, GPT-OSS is supported natively (commit 7221045777, PR #5901).
NATIVE_FROM = "0.15.0rc1"


def newest_row(rows: Sequence[Row] = ROWS) -> Row:
    """The newest release the table knows (a newer vllm-ascend is refused: nobody checked it)."""
    return max(rows, key=lambda r: r.version)


def native_attention(row: Row | None) -> bool:
    """True when upstream's own attention forward computes ``row``'s GPT-OSS layers: 0.19.1rc1 and later (layouts I
    and J build the sliding layers with GPT-OSS's band, ``attention.band_128_keys``; I also captures the sink layers
    for FULL_DECODE_ONLY graphs, which upstream's forward would capture without sinks); False where our forward runs
    them (0.11.0rc1 - 0.18.0: layouts B - G route the sink and sliding layers to our call)."""
    return (native_sinks(row) and row.caps["attention"].state != REFUSED
            and not any(p.startswith("attention.sink_window_forward") for p in LAYOUT_PATCHES.get(row.layout, ())))


def native_sinks(row: Row | None) -> bool:
    """True when ``row``'s vllm-ascend has GPT-OSS support of its own (``AscendAttentionBackendImpl`` takes
    ``sinks``, :data:`NATIVE_FROM` on): its cells run the calibration suite ``tests/cell/native_015`` (upstream's
    metadata builder, upstream's paths calibrated unwrapped), whatever we patch on top."""
    return row is not None and bool(row.caps) and row.version >= Version(NATIVE_FROM)


def cap_lines(row: Row | None) -> tuple[str, ...]:
    """One line per capability of ``row`` that is not plainly native: ``"<capability>: <state> - <note>"``."""
    if row is None:
        return ()
    return tuple(f"{name}: {cap.state} - {cap.note}" for name, cap in row.caps.items()
                 if cap.state != NATIVE)


@dataclass(frozen=True)
class NzRule:
    """How one vllm-ascend release decides whether unquantised bf16/fp16 MoE weights become FRACTAL_NZ.

    Attributes:
        releases: the vllm-ascend versions the rule covers (PEP 440 strings).
        function: the upstream function that decides.
        text: the rule in words.
        env_values: the ``VLLM_ASCEND_ENABLE_NZ`` values for which bf16 MoE weights are NZ-cast (the default is 1);
            ``None`` = NZ regardless of the variable.
        needs_eagle: the cast additionally needs eagle/eagle3 speculative decoding.
        never: bf16 MoE weights are never NZ-cast.
    """

    releases: tuple[str, ...]
    function: str
    text: str
    env_values: tuple[int, ...] | None = (1, 2)
    needs_eagle: bool = False
    never: bool = False

    def casts(self, env_value: int = 1, eagle: bool = False) -> bool:
        """Whether bf16 MoE weights are NZ-cast with ``VLLM_ASCEND_ENABLE_NZ=env_value`` (non-310P, not qwen3_next)."""
        if self.never:
            return False
        if self.needs_eagle and not eagle:
            return False
        return self.env_values is None or env_value in self.env_values


#: Read from the released wheels (``vllm_ascend/utils.py`` and the unquantised MoE method's
#: ``process_weights_after_loading``); docs/upstream.md §4.10.
NZ_RULES: tuple[NzRule, ...] = (
    NzRule(("0.11.0rc0",), "ops.common_fused_moe:process_weights_after_loading",
           "always on non-310P (no environment check)", env_values=None),
    NzRule(("0.11.0rc1", "0.11.0rc2"), "utils:is_enable_nz()",
           "VLLM_ASCEND_ENABLE_NZ != 0 (default 1): NZ by default"),
    NzRule(("0.11.0rc3",), "utils:is_enable_nz(dtype)", "never for fp16/bf16", never=True),
    NzRule(("0.11.0",), "utils:is_enable_nz(dtype)",
           "only with eagle/eagle3 speculative decoding, then VLLM_ASCEND_ENABLE_NZ != 0", needs_eagle=True),
    NzRule(("0.12.0rc1",), "utils:is_enable_nz()", "VLLM_ASCEND_ENABLE_NZ != 0 (default 1): NZ by default"),
    NzRule(("0.13.0rc1", "0.13.0rc2", "0.13.0rc3", "0.13.0", "0.14.0rc1", "0.15.0rc1"), "utils:maybe_trans_nz",
           "only with VLLM_ASCEND_ENABLE_NZ=2", env_values=(2,)),
)


def nz_rule(vllm_ascend: str) -> NzRule | None:
    """The :class:`NzRule` of a vllm-ascend release (exact version string), or ``None`` if not in :data:`NZ_RULES`."""
    for rule in NZ_RULES:
        if vllm_ascend in rule.releases:
            return rule
    return None


@dataclass(frozen=True)
class PairingRule:
    """A defect that upstream's native GPT-OSS code has with a vLLM other than the paired one, checked in the
    installed files by :func:`gptoss_patch.pairing.native_pairing_problems` on rows whose code runs unpatched.

    Attributes:
        patch: the patch (name in :func:`gptoss_patch.patches.all_specs`) whose structural check on ``layout``'s
            target tells that the installed vllm-ascend still has the defect (the check passes: the code is the
            defective one).
        layout: where that target lives (:data:`LAYOUTS` key).
        trigger: what the installed vLLM must do for the defect to matter (``gptoss_patch.pairing._TRIGGERS`` key).
        problem: the refusal text; ``{target}`` is filled in.
    """

    patch: str
    layout: str
    trigger: str
    problem: str


#: Per-release facts of the pairing: vLLM >= 0.17 hands FusedMoE's activation over as the ``MoEActivation`` Enum,
#: vllm-ascend 0.17.0rc1 - 0.18.0 compare it with a string (vllm-ascend #8463; patched there by ``moe.activation_name``).
#: A native row (H, I, stand-down) paired with such a vLLM would run every expert as plain SwiGLU.
NATIVE_PAIRING_RULES: tuple[PairingRule, ...] = (
    PairingRule("moe.activation_name", "G", "vllm_passes_enum",
                "the installed vLLM passes the MoE activation as the MoEActivation Enum and {target} compares it "
                "with a string: GPT-OSS experts would run plain SwiGLU (vllm-ascend #8463)"),
)




@dataclass(frozen=True)
class Decision:
    """The matrix's answer for one set of installed versions.

    Attributes:
        verdict: ``apply``, ``stand-down`` or ``refuse``.
        reason: one human sentence (shown by ``verify`` and in every guard error).
        row: the matrix row the decision rests on (``None`` for refuse without a row).
        exact: True when vllm-ascend and vLLM equal a tested row exactly.
        forced: True when ``GPTOSS_PATCH_FORCE=1`` overrode a refusal.
        structural_failures: for an untested build, the targets that failed the structural check.
    """

    verdict: str
    reason: str
    row: Row | None = None
    exact: bool = False
    forced: bool = False
    structural_failures: tuple[str, ...] = field(default_factory=tuple)


    @property
    def gaps(self) -> tuple[str, ...]:
        """The row's capabilities that are not plainly native (:func:`cap_lines`); empty without a row."""
        return cap_lines(self.row) if self.verdict != REFUSE else ()


def _parse(name: str, raw: str | None) -> Version | None:
    """``raw`` as a :class:`Version` of its *public* part (``0.11.0+empty`` -> ``0.11.0``); None stays None.

    Raises:
        ValueError: not PEP 440, or a tag-less source build (``0.1.dev1+g...``: setuptools-scm's version of a
            checkout without tags), which cannot be placed in the table.
    """
    if raw is None:
        return None
    try:
        version = Version(raw)
    except InvalidVersion:
        raise ValueError(f"{name} version {raw!r} is not a PEP 440 version") from None
    if version.release[:2] == (0, 1) and version.dev is not None and version.local:
        raise ValueError(f"{name} version {raw!r} is a source build without release tags (setuptools-scm's "
                         f"0.1.devN); set VLLM_VERSION to the release it was built from (vLLM) or "
                         f"GPTOSS_PATCH_FORCE=1 to apply the nearest tested release anyway")
    return Version(version.public)


def supported_releases(rows: Sequence[Row] = ROWS) -> list[str]:
    """The vllm-ascend releases with verdict *apply*, oldest first."""
    return [r.vllm_ascend for r in sorted(rows, key=lambda r: r.version) if r.verdict == APPLY]


def _supported_text(rows: Sequence[Row]) -> str:
    pairs = [f"vllm-ascend {r.vllm_ascend} with vllm {r.vllm}" for r in sorted(rows, key=lambda r: r.version)
             if r.verdict == APPLY]
    native = [r.vllm_ascend for r in sorted(rows, key=lambda r: r.version) if r.verdict == STAND_DOWN]
    return "; ".join(pairs) + (f"; native GPT-OSS (nothing to patch): {', '.join(native)}" if native else "")


def nearest_tested(version: Version, rows: Sequence[Row] = ROWS) -> Row | None:
    """The tested *apply* row of the same ``major.minor`` series nearest to ``version``.

    Prefers the newest tested row not newer than ``version``'s release (``0.11.0rc1.dev449`` →
    the 0.11 row); falls back to the oldest tested row of the series. None when the series has none.
    """
    series = [r for r in rows if r.verdict == APPLY and r.tested and r.version.release[:2] == version.release[:2]]
    if not series:
        return None
    series.sort(key=lambda r: r.version)
    not_newer = [r for r in series if r.version <= version]
    return not_newer[-1] if not_newer else series[0]


def decide(
    vllm_ascend: str | None,
    vllm: str | None,
    *,
    force: bool = False,
    structural_check: Callable[[Row], Sequence[str]] | None = None,
    rows: Sequence[Row] = ROWS,
    vllm_declared: bool = False,
) -> Decision:
    """Decide what to do for the installed ``vllm_ascend`` and ``vllm`` versions.

    Args:
        vllm_ascend: installed vllm-ascend version string, or None when not installed.
        vllm: installed vLLM version string, or None when not installed.
        force: apply the nearest row even when the build is refused (``GPTOSS_PATCH_FORCE=1``).
        structural_check: for a build that is not exactly a tested row, called with the candidate
            row; returns the list of failed targets (empty = compatible). Without it, such a build
            is refused ("cannot check structure").
        rows: the table (tests pass their own).
        vllm_declared: ``vllm`` is what ``VLLM_VERSION`` says, not what is installed (a source build): the pair is
            then never an exact tested pairing - patched rows take the structural check (both sides), native rows
            stand down only as "declared", and the caller checks the installed vLLM's code.

    Returns:
        A :class:`Decision`. Never raises for bad input: unparsable versions give *refuse* with a
        reason that names the string.
    """
    if vllm_ascend is None:
        return Decision(REFUSE, "vllm-ascend is not installed; gptoss-patch only patches vllm-ascend "
                                f"(supported: {_supported_text(rows)})")
    try:
        va = _parse("vllm-ascend", vllm_ascend)
        vv = _parse("vllm", vllm)
    except ValueError as exc:
        return Decision(REFUSE, f"{exc}; cannot place it in the version matrix")

    if vv is None:
        return Decision(REFUSE, f"vllm is not installed next to vllm-ascend {vllm_ascend}; install the paired "
                                f"vllm ({_supported_text(rows)})")

    newest = newest_row(rows)
    if va > newest.version:
        reason = (f"vllm-ascend {vllm_ascend} is newer than the newest release this gptoss-patch has checked "
                  f"({newest.vllm_ascend}); upgrade gptoss-patch, or set GPTOSS_PATCH_ALLOW_UNPATCHED=1 to serve "
                  "GPT-OSS on it unchecked")
        return Decision(REFUSE, reason)

    by_version = {r.version: r for r in rows}
    row = by_version.get(va)
    if row is None:
        # A local / post / dev build of a *refused* release (``0.13.0rc3+local``, ``0.11.0rc0.post1``) is that
        # release: same release and pre-release segment -> same refusal, whatever its structure.
        row = next((r for r in rows if r.verdict == REFUSE and r.version.release == va.release
                    and r.version.pre == va.pre), None)
    if row is not None and row.verdict == REFUSE:
        reason = f"vllm-ascend {vllm_ascend} is not supported: {row.note}. Supported: {_supported_text(rows)}"
        return _maybe_force(Decision(REFUSE, reason, row), force, rows, va)
    if row is not None and row.verdict == STAND_DOWN:
        if row.vllm is not None and Version(row.vllm) != vv:
            reason = (f"vllm-ascend {vllm_ascend} pairs with vllm {row.vllm}, not {vllm}: its native GPT-OSS code "
                      f"was not checked with that vLLM (install vllm=={row.vllm})")
            return _maybe_force(Decision(REFUSE, reason, row), force, rows, va)
        tested = "tested here" if row.tested else "not tested here, judged from its released source"
        declared = " (vLLM version declared by VLLM_VERSION: its code is checked at activation)" if vllm_declared else ""
        return Decision(STAND_DOWN, f"vllm-ascend {vllm_ascend} with vllm {vllm} supports GPT-OSS natively "
                                    f"({tested}){declared}; nothing to patch, the guard refuses what is still wrong "
                                    "upstream", row, exact=row.tested and not vllm_declared)
    if (row is not None and row.verdict == APPLY and row.vllm is not None and Version(row.vllm) == vv and row.tested
            and not vllm_declared):
        return Decision(APPLY, f"vllm-ascend {vllm_ascend} with vllm {vllm} is a tested release", row, exact=True)

    candidate = row if (row is not None and row.verdict == APPLY and row.tested) else nearest_tested(va, rows)
    if candidate is None and row is not None and row.verdict == APPLY:
        candidate = row  # an apply row no cell tests (yet): judged against its own layout, structurally
    if candidate is None:
        reason = (f"vllm-ascend {vllm_ascend} (vllm {vllm}) is not in the version matrix and no tested "
                  f"release of its series exists. Supported: {_supported_text(rows)}")
        return _maybe_force(Decision(REFUSE, reason), force, rows, va)

    if candidate is row and row is not None and not row.tested:
        what = f"vllm-ascend {vllm_ascend} with vllm {vllm} (not tested here; layout {row.layout})"
    elif row is None:
        what = f"vllm-ascend {vllm_ascend} with vllm {vllm}"
    else:
        what = f"vllm-ascend {vllm_ascend} with vllm {vllm} (tested pairing: vllm {candidate.vllm})"
    if structural_check is None:
        reason = f"untested build {what}; its structure was not checked"
        return _maybe_force(Decision(REFUSE, reason, candidate), force, rows, va)
    failures = tuple(structural_check(candidate))
    if failures:
        reason = (f"untested build {what} is structurally different from {candidate.vllm_ascend}: "
                  + "; ".join(failures))
        return _maybe_force(Decision(REFUSE, reason, candidate, structural_failures=failures), force, rows, va)
    return Decision(APPLY, f"untested build {what}, structurally compatible with {candidate.vllm_ascend}",
                    candidate)


def _maybe_force(decision: Decision, force: bool, rows: Sequence[Row], va: Version) -> Decision:
    if not force:
        return decision
    if decision.row is not None and decision.row.verdict == STAND_DOWN:
        return Decision(STAND_DOWN, f"FORCED by GPTOSS_PATCH_FORCE=1: stand-down as {decision.row.vllm_ascend}; "
                                    f"would otherwise refuse: {decision.reason}", decision.row, forced=True)
    row = decision.row if (decision.row is not None and decision.row.verdict == APPLY) else None
    if row is None:
        row = nearest_tested(va, rows)
    if row is None:  # never a layout of another major.minor series: its targets and defects are other code
        return decision
    return Decision(APPLY, f"FORCED by GPTOSS_PATCH_FORCE=1 using the {row.vllm_ascend} layout; "
                           f"would otherwise refuse: {decision.reason}", row, forced=True,
                    structural_failures=decision.structural_failures)


def _caps_text(row: Row) -> str:
    if not row.caps:
        return "-"
    return "; ".join(f"{name} {cap.state}" for name, cap in row.caps.items() if cap.state != NATIVE) or "all native"


def table(rows: Sequence[Row] = ROWS) -> list[Mapping[str, str]]:
    """The matrix as rows of strings for ``verify --matrix`` and the README (release, paired vllm, torch /
    torch-npu, CANN, verdict, layout family, tested, the capabilities that are not native, note)."""
    out = []
    for r in sorted(rows, key=lambda r: r.version):
        out.append({"vllm-ascend": r.vllm_ascend, "vllm": r.vllm or "-", "torch / torch-npu": f"{r.torch} / {r.torch_npu}",
                    "CANN": r.cann, "verdict": r.verdict, "layout": r.layout or "-",
                    "tested": f"yes (cell-{r.vllm_ascend})" if r.tested else "no",
                    "not native": _caps_text(r), "note": r.note})
    newest = newest_row(rows).vllm_ascend
    out.append({"vllm-ascend": f"> {newest}", "vllm": "-", "torch / torch-npu": "-", "CANN": "-",
                "verdict": REFUSE, "layout": "-", "tested": "no", "not native": "-",
                "note": "not checked yet: upgrade gptoss-patch"})
    return out


def markdown(rows: Sequence[Row] = ROWS) -> str:
    """The matrix as the Markdown table the README shows (tested by ``tests/unit/test_readme.py``)."""
    cols = ["vllm-ascend", "vllm", "torch / torch-npu", "CANN", "verdict", "layout", "tested", "not native", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table(rows):
        lines.append("| " + " | ".join(r[c] for c in cols) + " |")
    return "\n".join(lines)


#: For each capability that a row can refuse: what in a user's configuration meets the refusal (README "What is
#: refused", first column).
REFUSED_WHEN: dict[str, str] = {
    "attention_graph": "FULL_DECODE_ONLY ACL graphs (`cudagraph_mode` `FULL_DECODE_ONLY`)",
    "quantized_moe": "a quantized checkpoint (W8A8 or another vllm-ascend quantization method)",
    "checkpoint_bf16": "a BF16 checkpoint",
    "checkpoint_mxfp4": "an official MXFP4 checkpoint (`openai/gpt-oss-*`)",
    "atlas_310p": "an Atlas 300I Duo (310P)",
    "paged_attention_shapes": "`additional_config.pa_shape_list` with FULL_DECODE_ONLY graphs",
    "context_parallel": "prefill or decode context parallelism above 1",
    "model_runner_v2": "model runner v2 (`VLLM_USE_V2_MODEL_RUNNER=1`)",
}

#: For each capability that a row can refuse: the setting that avoids the refusal (README "What is refused"; the guard's
#: own messages name the same settings with the row's reason).
AVOIDS: dict[str, str] = {
    "attention_graph": "serve with PIECEWISE graphs: `--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}'` "
                       "(or `--enforce-eager`)",
    "quantized_moe": "serve a BF16 checkpoint (e.g. `unsloth/gpt-oss-120b-BF16`) or the official MXFP4 one where "
                     "`checkpoint_mxfp4` is patched",
    "checkpoint_bf16": "use another release of the series (0.23.0 or 0.25.1rc1)",
    "checkpoint_mxfp4": "serve a BF16 checkpoint (`--dtype bfloat16` does not make vLLM dequantize MXFP4 on NPU)",
    "atlas_310p": "serve on Atlas A2 / A3",
    "paged_attention_shapes": "remove `pa_shape_list` from `--additional-config`",
    "context_parallel": "serve with `--prefill-context-parallel-size 1 --decode-context-parallel-size 1` (the default)",
    "model_runner_v2": "unset `VLLM_USE_V2_MODEL_RUNNER` (the v1 runner, the default)",
}


def _ranges(releases: Sequence[str], refused_rows: bool = False) -> str:
    """``a, b, c`` consecutive in :data:`ROWS` order shown as ``a – c`` runs, joined by ``, ``; the refused rows are
    left out of the order unless ``refused_rows`` (a capability's range runs across them: they have no capabilities)."""
    order = [r.vllm_ascend for r in sorted(ROWS, key=lambda r: r.version) if refused_rows or r.verdict != REFUSE]
    runs: list[list[str]] = []
    for rel in sorted(releases, key=order.index):
        if runs and order.index(rel) == order.index(runs[-1][-1]) + 1:
            runs[-1].append(rel)
        else:
            runs.append([rel])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]} – {run[-1]}" for run in runs)


def refusals_markdown(rows: Sequence[Row] = ROWS) -> str:
    """The README's table of what is refused and the setting that avoids it, from the rows' *refused* capabilities
    :data:`REFUSED_WHEN` and :data:`AVOIDS` (tested by ``tests/unit/test_readme.py``). Raises ``KeyError`` for a
    refused capability without an entry in both."""
    lines = ["| when you serve GPT-OSS with | refused on vllm-ascend | the setting that avoids it |", "|---|---|---|"]
    for cap in CAPABILITIES:
        where = [r.vllm_ascend for r in rows if r.caps.get(cap) is not None and r.caps[cap].state == REFUSED]
        if where:
            lines.append(f"| {REFUSED_WHEN[cap]} (`{cap}`) | {_ranges(where)} | {AVOIDS[cap]} |")
    lines.append(f"| a release newer than {newest_row(rows).vllm_ascend}, an unpaired vLLM, or a refused row | "
                 f"{_ranges([r.vllm_ascend for r in rows if r.verdict == REFUSE], refused_rows=True)}, > "
                 f"{newest_row(rows).vllm_ascend} | "
                 "install a release of the table with its paired vLLM (`verify --matrix`), or upgrade gptoss-patch |")
    return "\n".join(lines)


def series_markdown(rows: Sequence[Row] = ROWS) -> str:
    """The README's release table by series: consecutive rows with the same verdict and layout in one line, with the
    cells that test them (tested by ``tests/unit/test_readme.py``; the full table is :func:`markdown`)."""
    groups: list[list[Row]] = []
    for r in sorted(rows, key=lambda r: r.version):
        if groups and (groups[-1][-1].verdict, groups[-1][-1].layout) == (r.verdict, r.layout):
            groups[-1].append(r)
        else:
            groups.append([r])
    lines = ["| vllm-ascend | verdict | layout | tested here (nox cell) |", "|---|---|---|---|"]
    for g in groups:
        span = g[0].vllm_ascend if len(g) == 1 else f"{g[0].vllm_ascend} – {g[-1].vllm_ascend}"
        cells = ", ".join(r.vllm_ascend for r in g if r.tested) or "judged from sources, not run"
        lines.append(f"| {span} | {g[0].verdict} | {g[0].layout or '-'} | {cells} |")
    lines.append(f"| > {newest_row(rows).vllm_ascend} | {REFUSE} | - | not checked yet: upgrade gptoss-patch |")
    return "\n".join(lines)
