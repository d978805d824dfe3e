"""``python -m gptoss_patch.verify --selftest``: small GPT-OSS cases through the code paths that serve, on the device
present, against an independent float32 reference.

Where the numbers come from:

* **What runs** is the installed vllm-ascend with whatever gptoss-patch did to it in this process: on a patched row
  (layouts B, C, E, F) the patched ``AscendAttentionBackendImpl`` (entered as vLLM enters it,
  :func:`gptoss_patch.selftest.attention.run_forward`), the patched unquantized MoE method (a real ``FusedMoE``
  built with the arguments of vLLM's ``gpt_oss.py`` ``MLPBlock``, :func:`gptoss_patch.selftest.moe.build_layer`)
  and the patched ``AscendYaRNRotaryEmbedding``; on a row with native sinks (0.15.0rc1+) the release's own
  ``AscendAttentionBackendImpl.forward`` fed by its own metadata builder (:mod:`gptoss_patch.selftest.native`):
  upstream's attention, or ours where layouts H and G (0.15.0rc1 - 0.18.0) patch ``forward_impl``. The operators are the real ``torch_npu`` on an Ascend host, the
  CPU NPU simulator of gptoss-patch-testkit (docs/simulator.md).
* **The reference** is transformers' GPT-OSS modeling code in float32 on the same (bf16-rounded) inputs:
  ``eager_attention_forward`` with its sink column and ``causal_mask_function`` /
  ``sliding_window_causal_mask_function`` (:func:`~gptoss_patch.selftest.attention.reference_output`),
  ``GptOssMLP`` (:func:`~gptoss_patch.selftest.moe.reference`), ``GptOssRotaryEmbedding`` - never the plain-torch
  math of :mod:`gptoss_patch.kernels`.

Cases and tolerances (all inputs bfloat16, the dtype GPT-OSS serves in; docs/operators.md for the operator facts):

* **attention** - GQA 8:1, head_dim 64 (gpt-oss-120b's per-rank geometry at TP 8), learned sinks, the sliding window
  of 128 keys and full layers; PrefillNoCache at lengths 127/128/129, ChunkedPrefill, PrefillCacheHit, DecodeOnly at
  KV lengths 127/128/129/300, and a DecodeOnly batch padded to a graph size (patched rows); each on every operator
  path the stack can take (``v2``: ``npu_fused_infer_attention_score_v2`` with ``learnable_sink``; ``lse``: the LSE
  rescale; a native row has its one path). Error: ``max_e |out_e - ref_e| / (|ref_e| + sum_j p_j |v_j,e|)`` over
  the real rows (:func:`_attention_result`). Tolerance :data:`ATTENTION_TOL` ``= 3 * 2**-8``: the fused operator
  accumulates in float32 and rounds to bf16 (unit roundoff ``u = 2**-8``) the softmax probabilities before the ``P·V``
  matmul (``<= u * sum_j p_j |v_j|``) and the output (``<= u * |out|``), and the LSE path rounds its rescaled output
  once more (``<= u * |out|``).
  A sliding row whose release *deviates* (``sparse_mode 4`` with ``pre_tokens = 128``: 129 keys, docs/operators.md
  "Sliding-window band") is compared with the window-129 reference, the documented behaviour of that release.
* **moe** - swigluoai with both expert biases at gpt-oss-120b's TP-8 per-rank shape (hidden 2880, intermediate 360;
  8 experts instead of 128, top-4), 64 tokens, unpadded (``GPTOSS_PATCH_MOE_PAD=never`` with ``VLLM_ASCEND_ENABLE_NZ=0``:
  intermediate 360 in ND, since the grouped matmul rejects an NZ weight with K = 360) and padded (``=always``: 368, the
  FRACTAL_NZ alignment, under the release's default NZ mode), the communication method the release's runner picks at
  world size 1.
  Error ``max|out - ref| / max|ref|``; tolerance: transformers' own ``GptOssMLP`` run in bf16 on the same inputs
  (its error is the model's inherent bf16 noise) plus one bf16 rounding of the output (``2**-8``), as
  tests/cell/test_moe.py states.
* **graph** - FULL_DECODE_ONLY capture -> replay -> per-step parameter update equal to eager (:func:`_graph`), per
  operator path, through vllm-ascend's ``ACLGraphWrapper`` and the release's update entry point
  (:mod:`gptoss_patch.selftest.graph`); patched rows 0.11 - 0.14 (on 0.15.0rc1 - 0.19.1rc1 the same capture is
  served end to end by the cells, tests/cell/native_015/test_native_serve.py, and not yet a self-test case).
* **yarn** - the cos/sin cache of the YaRN rope built with GPT-OSS's ``rope_scaling`` (factor 32, beta 32/1, original
  4096, ``truncate: false``) at all 131072 positions, float32 (the cache dtype vLLM keeps for the rope); tolerance
  ``1e-5`` absolute (both sides evaluate ``cos(position * inv_freq) * mscale`` in float32; the rounded ramp of an
  unpatched release is off by up to 2.7).

On a native row the MoE case is the layer-0 MLP of the tiny checkpoint loaded by vLLM's ``get_model`` (per-rank
intermediate 360; hidden 64 instead of 2880, so that the whole model loads in seconds).

Placement: the harnesses put in NPU memory what the model runner keeps there (q/k/v, the paged KV caches, the
block table, slot mapping, ``query_start_loc`` and - per release - ``seq_lens``, the masks, the layers' parameters,
the MoE input; the ``*_cpu`` metadata on the host, as the runner keeps it) and copy results back to the host for the
float32 reference. On the simulator every case runs under its placement audit
(:mod:`gptoss_patch_testkit.npu_sim.placement`): an emulated operator given a host tensor, or an operation mixing
host and NPU memory, fails the case and names the operator and argument - what a real NPU would reject. On an Ascend
host the harnesses bring up vLLM's worker state without the simulator, with HCCL
(:func:`gptoss_patch.selftest.worker.distributed_backend`). That branch has not run on hardware here (no NPU).

Not covered here yet (listed in the result under ``not_covered``): the rope of native rows.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

#: Window of GPT-OSS's sliding layers (``sliding_window: 128`` in the released config.json).
WINDOW = 128
#: Keys a deviating release's ``sparse_mode 4`` band admits (``pre_tokens = 128``; docs/operators.md).
DEVIATING_WINDOW = 129
#: Attention geometry: gpt-oss-120b per rank at TP 8 (64 query heads / 8, 8 KV heads / 8), head_dim 64.
HEADS, KV_HEADS, HEAD_DIM = 8, 1, 64
#: MoE: gpt-oss-120b hidden size and per-rank expert intermediate at TP 8 (2880 / 8).
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOKENS = 2880, 360, 8, 64
#: Attention tolerance, relative to each element's scale (see :func:`_attention_result`): three bf16 roundings
#: (unit roundoff ``u = 2**-8``) - the probabilities before the ``P·V`` matmul, the operator's output, and the LSE
#: path's rescaled output.
ATTENTION_TOL = 3 * 2 ** -8
#: Absolute tolerance of the float32 YaRN cos/sin cache.
YARN_TOL = 1e-5


@dataclass
class CaseResult:
    """One self-test line.

    Attributes:
        case: name, e.g. ``"attention/v2/decode_127_128_129/sliding"``.
        max_error: the measured error (None when the case did not run).
        tolerance: the bound it must meet.
        ok: passed (skipped cases count as passed and say why in ``note``).
        note: what the error measures, or why the case was skipped.
        error: the exception text when the case raised (``ok`` False).
        skipped: not run on this device (reason in ``note``).
    """

    case: str
    max_error: float | None
    tolerance: float | None
    ok: bool
    note: str = ""
    error: str | None = None
    skipped: bool = False

    def line(self) -> str:
        """``case  max error  tolerance  PASS|FAIL|skip  note``."""
        verdict = "skip" if self.skipped else ("PASS" if self.ok else "FAIL")
        err = "-" if self.max_error is None else f"{self.max_error:.2e}"
        tol = "-" if self.tolerance is None else f"{self.tolerance:.2e}"
        extra = self.error or self.note
        return f"{self.case:<52} {err:>9} {tol:>9}  {verdict}" + (f"  {extra}" if extra else "")


@dataclass
class SelfTest:
    """The whole self-test (``verify --json`` key ``selftest``)."""

    device: str
    rows: str
    cases: list[CaseResult] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: The case families this row must run (the part of a case name before its first ``/``): a family with no case
    #: fails the self-test (:attr:`missing`), so a device that offers no attention operator path cannot pass it.
    required: tuple[str, ...] = ()

    @property
    def missing(self) -> list[str]:
        """The :attr:`required` families without a single case."""
        ran = {c.case.split("/", 1)[0] for c in self.cases}
        return [f for f in self.required if f not in ran]

    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(c.ok for c in self.cases) and not self.missing

    @property
    def failed(self) -> list[str]:
        return [c.case for c in self.cases if not c.ok] + [f"{f} (no case ran)" for f in self.missing]

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "rows": self.rows, "ok": self.ok, "failed": self.failed,
                "seconds": round(self.seconds, 2), "cases": [asdict(c) for c in self.cases],
                "not_covered": list(self.not_covered), "required": list(self.required), "missing": self.missing}

    def lines(self) -> list[str]:
        out = [f"self-test on {self.device} ({self.rows}); reference: transformers GPT-OSS, float32",
               f"{'case':<52} {'max err':>9} {'tolerance':>9}  result"]
        out += [c.line() for c in self.cases]
        out += [f"not covered: {n}" for n in self.not_covered]
        out.append(f"self-test {'passed' if self.ok else 'FAILED: ' + ', '.join(self.failed)} "
                   f"({self.seconds:.1f} s)")
        return out


def _run_case(results: list[CaseResult], name: str, fn: Callable[[], CaseResult]) -> None:
    """Run one case; an exception becomes a failed line naming the case (never raises)."""
    try:
        results.append(fn())
    except Exception as exc:  # noqa: BLE001 - reported as the case's failure
        results.append(CaseResult(name, None, None, False, error=f"{type(exc).__name__}: {exc}"[:300]))


def _placement_audit():
    """The simulator's placement audit when the NPU is simulated in this process, else nothing to audit
    (:func:`gptoss_patch.selftest.device.placement_audit`)."""
    from gptoss_patch.selftest import device

    return device.placement_audit()


# ------------------------------------------------------------------------------------------------------ attention

#: ``(name, seqs as (cached, new) pairs, forced state name or None, pad_to)`` of the patched rows.
PATCHED_ATTENTION = (
    ("prefill_127_128_129", [(0, 127), (0, 128), (0, 129)], None, None),
    ("chunked_prefill", [(300, 1), (0, 200), (150, 60), (129, 1), (0, 3)], None, None),
    ("prefix_hit", [(200, 50), (100, 28), (128, 129)], "PrefillCacheHit", None),
    ("decode_127_128_129", [(126, 1), (127, 1), (128, 1), (299, 1)], None, None),
    ("decode_graph_padded", [(127, 1), (128, 1), (5, 1)], None, 8),
)

#: The same states on a native row (its model runner reaches PrefillNoCache, ChunkedPrefill and DecodeOnly with
#: chunked prefill on; a prefix hit is a ChunkedPrefill there); lengths up to 130 cross the 129-key band of a deviating
#: release.
NATIVE_ATTENTION = (
    ("prefill_127_128_129_130", [(0, 127), (0, 128), (0, 129), (0, 130)]),
    ("chunked_prefill_prefix_hit", [(300, 1), (0, 200), (150, 60), (129, 1), (128, 129)]),
    ("decode_127_128_129_130", [(126, 1), (127, 1), (128, 1), (129, 1), (299, 1)]),
)


def _sinks() -> torch.Tensor:
    """bf16 ``[HEADS]`` sinks, ``N(0, 4)`` (GPT-OSS's trained sinks are of that order)."""
    return (torch.randn(HEADS, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)


def _attention_result(name: str, case: Any, out: torch.Tensor, sinks: torch.Tensor, window: int | None,
                      note: str = "") -> CaseResult:
    """Compare ``out`` ``[T, N, D]`` (bf16; the real rows first) with transformers' float32 attention of ``case``.

    Error: ``max_e |out_e - ref_e| / (|ref_e| + sum_j p_j |v_j,e|)`` over the real rows - the error of each element
    relative to the scale bf16 arithmetic can reach there (``sum_j p_j |v_j|`` is the same attention over ``|v|``,
    computed by the same reference with ``|v|``). Tolerance :data:`ATTENTION_TOL`.
    """
    import dataclasses

    from gptoss_patch.selftest.attention import reference_output

    ref = reference_output(case, sinks=sinks, sliding_window=window, scale=HEAD_DIM ** -0.5)
    scale = reference_output(dataclasses.replace(case, full_v=[v.abs() for v in case.full_v]), sinks=sinks,
                             sliding_window=window, scale=HEAD_DIM ** -0.5)
    n = sum(new for _, new in case.seqs)
    got = out[:n].cpu().float().reshape(ref.shape)  # the result, copied back to the host
    rel = (got - ref).abs() / (ref.abs() + scale).clamp_min(1e-6)
    err = rel.max().item() if not torch.isnan(got).any() else float("nan")
    return CaseResult(name, err, ATTENTION_TOL, err <= ATTENTION_TOL,  # NaN (an unwritten row) fails
                      note or "max |out-ref| / (|ref| + attention of |v|)")


def _patched_attention(results: list[CaseResult], paths: list[str]) -> None:
    from vllm_ascend.attention.attention_v1 import AscendAttentionState

    from gptoss_patch.selftest.attention import forced_path
    from gptoss_patch.selftest.attention import build_case, make_impl, run_forward

    sinks = _sinks()
    for path in paths:
        for i, (label, seqs, state, pad_to) in enumerate(PATCHED_ATTENTION):
            for window in (WINDOW, None):
                name = f"attention/{path}/{label}/{'sliding' if window else 'full'}"

                def one(seqs=seqs, state=state, pad_to=pad_to, window=window, name=name, i=i):
                    case = build_case(seqs, num_heads=HEADS, num_kv_heads=KV_HEADS, dtype=torch.bfloat16,
                                      seed=100 + i, pad_to=pad_to,
                                      state=getattr(AscendAttentionState, state) if state else None)
                    with forced_path(path):
                        impl = make_impl(HEADS, KV_HEADS, window, sinks)
                        out, _ = run_forward(impl, case)
                    return _attention_result(name, case, out, sinks, window)

                _run_case(results, name, one)


def _native_attention(results: list[CaseResult], deviates: bool) -> None:
    from gptoss_patch.selftest import native as n015

    cfg, _ = n015.vllm_context(dtype="bfloat16")  # bf16: the dtype GPT-OSS serves in
    sinks = _sinks()
    for i, (label, seqs) in enumerate(NATIVE_ATTENTION):
        for window in (WINDOW, None):
            name = f"attention/native/{label}/{'sliding' if window else 'full'}"
            ref_window = (DEVIATING_WINDOW if deviates else WINDOW) if window else None

            def one(seqs=seqs, window=window, name=name, ref_window=ref_window, i=i):
                case = n015.build_case(cfg, seqs, num_heads=HEADS, num_kv_heads=KV_HEADS, dtype=torch.bfloat16,
                                       seed=100 + i, sliding_window=window)
                impl = n015.make_impl(cfg, num_heads=HEADS, num_kv_heads=KV_HEADS, sliding_window=window,
                                      sinks=sinks)
                out = n015.run_native_forward(cfg, impl, case)  # ours where layouts H / G patch forward_impl
                note = (f"reference window {ref_window}: the documented 129-key band of this release "
                        "(docs/operators.md)" if ref_window == DEVIATING_WINDOW else "")
                return _attention_result(name, case, out, sinks, ref_window, note)

            _run_case(results, name, one)


# ------------------------------------------------------------------------------------------------------------ MoE


def _moe(results: list[CaseResult], cfg: Any) -> None:
    from gptoss_patch.selftest.moe import (build_layer, env_var, make_tokens, make_weights, reference, rel_err,
                                               run_layer)

    w = make_weights(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, seed=120).rounded(torch.bfloat16)
    x = make_tokens(w, MOE_TOKENS, seed=8, dtype=torch.bfloat16, min_gap=0.1)
    ref = reference(w, x)
    hf16 = rel_err(reference(w, x, torch.bfloat16), ref)
    tol = hf16 + 2 ** -8
    # unpadded: the experts stay ND at 360 (VLLM_ASCEND_ENABLE_NZ=0; an NZ weight with K = 360 is rejected by the
    # grouped matmul); padded: 368 under the release's default NZ mode (FRACTAL_NZ where it casts)
    for label, policy, nz, inter in (("unpadded_360_nd", "never", "0", MOE_INTER), ("padded_368", "always", None, 368)):
        name = f"moe/swigluoai_biases/120b_tp8_rank/{label}"

        def one(policy=policy, nz=nz, inter=inter, name=name):
            with env_var("GPTOSS_PATCH_MOE_PAD", policy), \
                    (env_var("VLLM_ASCEND_ENABLE_NZ", nz) if nz else contextlib.nullcontext()):
                layer = build_layer(cfg, w, torch.bfloat16)
            got = tuple(layer.w2_weight.shape)
            if got != (MOE_EXPERTS, inter, MOE_HIDDEN):
                return CaseResult(name, None, tol, False, error=f"w2 shape {list(got)}, expected "
                                                                 f"{[MOE_EXPERTS, inter, MOE_HIDDEN]}")
            err = rel_err(run_layer(cfg, layer, w, x).cpu(), ref)
            return CaseResult(name, err, tol, err <= tol,
                              f"max|out-ref|/max|ref|; tol transformers-bf16 {hf16:.1e} + 2^-8")

        _run_case(results, name, one)


# ---------------------------------------------------------------------------------------------------------- graph

#: Decode batch sizes of the graph case, padded up to the capture sizes (4, 8): padded and exact batches.
GRAPH_STEPS = (3, 8, 4, 7, 2, 8)


def _graph(results: list[CaseResult], paths: list[str]) -> None:
    """FULL_DECODE_ONLY: capture at 4 and 8 (GPT-OSS sliding + full layers with sinks), replay each decode step with
    vllm-ascend's per-step parameter update, and compare with the same model run eagerly; KV lengths start at
    120 ... 255 and cross the 128-key window and block edges. Error ``max|graph - eager| / max|eager|`` over the real
    rows of every output; tolerance ``2**-8`` (one bf16 rounding: the captured launch may be the ``.out`` form of
    another operator path computing the same attention, ``kernels.attention.graph_path``)."""
    from gptoss_patch.selftest.attention import forced_path
    from gptoss_patch.selftest.graph import Harness, graph_env

    tol = 2 ** -8
    for path in paths:
        name = f"graph/{path}/full_decode_only/capture_replay_update"

        def one(path=path, name=name):
            with graph_env(), forced_path(path):
                hz = Harness(["sliding", "full"], init_lens=(120, 126, 127, 128, 129, 200, 250, 255), offsets=[0, 0],
                             sizes=(4, 8), dtype=torch.bfloat16)
                hz.capture()
                err = 0.0
                for step, b in enumerate(GRAPH_STEPS):
                    active = [(step * 3 + i) % hz.num_reqs for i in range(b)]
                    b, _, outs_g, outs_e, _ = hz.step(active)
                    for og, oe in zip(outs_g, outs_e):
                        e = oe[:b].float()
                        err = max(err, ((og[:b].float() - e).abs().max() / e.abs().max()).item())
            return CaseResult(name, err, tol, err <= tol, f"{len(GRAPH_STEPS)} steps; max|graph-eager|/max|eager|")

        _run_case(results, name, one)


def _native_moe(results: list[CaseResult], cfg: Any, ckpt: str) -> None:
    """A native row's MoE as vLLM builds and loads it (``get_model`` on the tiny checkpoint: the MLP of layer 0 with
    gpt-oss-120b's per-rank intermediate 360 at TP 8, hidden 64, 8 experts, top-4; whatever gptoss-patch does to it on
    this row - layout G's ``moe.activation_name`` - included), 64 tokens in bf16, against transformers' ``GptOssMLP``
    of the same checkpoint in float32; tolerance transformers' own bf16 error + ``2**-8`` (as :func:`_moe`)."""
    from transformers import GptOssForCausalLM

    from gptoss_patch.selftest import native as n015
    from gptoss_patch.selftest.moe import rel_err

    name = "moe/swigluoai_biases/native_model_layer0_inter360"

    def one():
        native = n015.load_native_model(cfg)
        x = n015.moe_input(0, MOE_TOKENS).to(torch.bfloat16)  # host; the layer gets an NPU copy
        with torch.no_grad():
            got = n015.run_native_moe(native, 0, x.to("npu")).cpu().float()
            ref = GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval().model.layers[0].mlp(
                x.float()[None])[0][0]
            ref16 = GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval().model.layers[0].mlp(
                x[None])[0][0].float()
        hf16 = rel_err(ref16, ref)
        tol = hf16 + 2 ** -8
        err = rel_err(got, ref)
        return CaseResult(name, err, tol, err <= tol, f"max|out-ref|/max|ref|; tol transformers-bf16 {hf16:.1e} + 2^-8")

    _run_case(results, name, one)


# ----------------------------------------------------------------------------------------------------------- YaRN


def _yarn(results: list[CaseResult], cfg: Any, ckpt: str) -> None:
    name = "yarn/cos_sin_cache/truncate_false"

    def one():
        import inspect

        from transformers import AutoConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
        from vllm.model_executor.layers.rotary_embedding import YaRNScalingRotaryEmbedding
        from vllm_ascend.ops.rotary_embedding import AscendYaRNRotaryEmbedding

        from gptoss_patch.selftest import worker as vllm_setup

        hf = AutoConfig.from_pretrained(ckpt)
        s = hf.rope_scaling
        if s.get("truncate") is not False:
            raise RuntimeError(f"the self-test checkpoint's rope_scaling is not GPT-OSS's: {s}")
        # vLLM >= 0.12's get_rope passes truncate= (from rope_parameters); vLLM 0.11 does not pass it
        extra = {"truncate": False} if "truncate" in inspect.signature(YaRNScalingRotaryEmbedding).parameters else {}
        with vllm_setup.ascend_context(vllm_config=cfg):
            rope = AscendYaRNRotaryEmbedding(HEAD_DIM, HEAD_DIM, s["original_max_position_embeddings"], hf.rope_theta,
                                             True, s["factor"], torch.float32, beta_fast=s["beta_fast"],
                                             beta_slow=s["beta_slow"], **extra)
        positions = torch.arange(hf.max_position_embeddings)[None]
        cos, sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
        cache = rope.cos_sin_cache.float()
        half = cache.shape[-1] // 2
        err = max((cache[:, :half] - cos[0]).abs().max().item(), (cache[:, half:] - sin[0]).abs().max().item())
        return CaseResult(name, err, YARN_TOL, err <= YARN_TOL, f"{cache.shape[0]} positions, float32, max|diff|")

    _run_case(results, name, one)


# ------------------------------------------------------------------------------------------------------------ run


@contextlib.contextmanager
def _checkpoint():
    """A tiny GPT-OSS checkpoint (GPT-OSS's config keys and rope_scaling, hidden 64, 2 layers) in a temporary
    directory, for the engine config the MoE and rope are built under."""
    from gptoss_patch.selftest.tiny import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="gptoss-selftest-") as tmp:
        write_checkpoint(tmp, preset="tiny", seed=0, tokenizer=False, num_hidden_layers=2, num_local_experts=4,
                         vocab_size=512, pad_token_id=511, eos_token_id=510)
        yield tmp


#: The case families every self-test of a patched / native row must run (:attr:`SelfTest.required`).
REQUIRED_PATCHED = ("attention", "graph", "moe", "yarn")
REQUIRED_NATIVE = ("attention", "moe")


def run(status: Any = None) -> SelfTest:
    """Run the self-test for the stack of this process (activated: :func:`gptoss_patch.verify.collect` does it; off an
    NPU, ``import torch_npu`` must resolve to gptoss-patch-testkit's simulator, ``GPTOSS_PATCH_SIMULATE_NPU=1``).

    Args:
        status: :func:`gptoss_patch.status` (default: read it).

    Returns:
        :class:`SelfTest`; never raises for a failing case (the case says what went wrong), nor when ``torch_npu``
        cannot be imported or vLLM's bring-up fails (a failed ``bring-up`` line with the reason). On a stack that is not
        covered (decision *refuse* / *disabled*) it has no cases and is not ok. On the simulator the cases run under
        its placement audit (:mod:`gptoss_patch_testkit.npu_sim.placement`): a tensor left in host memory where a
        real NPU needs device memory fails its case, naming the operator and the argument.
    """

    with _placement_audit():
        return _run(status)


def _run(status: Any) -> SelfTest:
    from gptoss_patch import environment, matrix
    from gptoss_patch._state import status as current_status

    start = time.monotonic()
    status = status or current_status()
    versions = environment.installed_versions()
    device = ("the CPU NPU simulator, placement audited" if versions.simulated_npu
              else f"torch_npu {versions.torch_npu}")
    row = next((r for r in matrix.ROWS if r.vllm_ascend == status.row), None)
    result = SelfTest(device=device, rows=f"vllm-ascend {versions.vllm_ascend}, decision {status.decision}")
    caps = status.capabilities or {}
    if status.decision not in (matrix.APPLY, matrix.STAND_DOWN) or row is None:
        result.not_covered.append(f"everything: the stack is not covered ({status.reason})")
        result.seconds = time.monotonic() - start
        return result
    native = matrix.native_sinks(row)  # upstream's metadata builder; its attention, or ours where H / G patch it
    result.required = REQUIRED_NATIVE if native else REQUIRED_PATCHED
    try:
        _run_cases(result, native, caps)
    except Exception as exc:  # noqa: BLE001 - the device or vLLM's bring-up failed: a failed line, never a traceback
        result.cases.append(CaseResult("bring-up", None, None, False, error=f"{type(exc).__name__}: {exc}"[:500]))
    result.seconds = time.monotonic() - start
    return result


def _run_cases(result: SelfTest, native: bool, caps: dict) -> None:
    """Append the cases of a native (``native``) or patched row to ``result``; raises when the ``torch_npu`` present
    cannot be imported (:data:`gptoss_patch.selftest.device.NO_NPU_HINT`) or vLLM's bring-up fails."""
    from gptoss_patch import matrix
    from gptoss_patch.kernels import attention as kernels
    from gptoss_patch.selftest import device

    torch_npu = device.torch_npu()
    if native:
        deviates = caps.get("attention", {}).get("state") == matrix.DEVIATES
        _native_attention(result.cases, deviates)
        from gptoss_patch.selftest import native as n015

        cfg, ckpt = n015.vllm_context(dtype="bfloat16")
        _native_moe(result.cases, cfg, ckpt)
        result.not_covered += ["YaRN of a native row (upstream's code; tests/cell/native_015 calibrates it)",
                               "FULL_DECODE_ONLY (our capture on 0.15.0rc1 - 0.19.1rc1, served by the cells; "
                               "upstream's own graph code from 0.20.2rc1)",
                               "the MoE padded to 368 (native rows keep bf16 experts in ND: no padding)"]
    else:
        paths = [p for p in (kernels.V2, kernels.LSE) if _path_available(torch_npu, p)]
        if not paths:  # the attention and graph families then have no case: say why instead of passing without them
            result.not_covered.append(f"attention and graph: {_no_path_reason(torch_npu)}")
        _patched_attention(result.cases, paths)
        _graph(result.cases, paths)
        from gptoss_patch.selftest import worker as vllm_setup

        with _checkpoint() as ckpt:
            cfg = vllm_setup.engine_config(ckpt)
            _moe(result.cases, cfg)
            _yarn(result.cases, cfg, ckpt)


def _no_path_reason(torch_npu: Any) -> str:
    """Why :func:`gptoss_patch.kernels.attention.detect_path` finds no operator path on this ``torch_npu``."""
    from gptoss_patch.kernels import attention as kernels

    try:
        return f"path {kernels.detect_path(torch_npu)} detected, yet no path runs"
    except (kernels.SinkAttentionUnavailable, ValueError) as exc:
        return str(exc)


def _path_available(torch_npu: Any, path: str) -> bool:
    """True when the attention operator path ``path`` (``v2`` / ``lse``) can run on this torch_npu: the operator has
    the argument the path needs (``learnable_sink`` / ``softmax_lse_flag``; :func:`gptoss_patch.kernels.attention.
    detect_path` with the path forced raises otherwise)."""
    from gptoss_patch.kernels import attention as kernels
    from gptoss_patch.selftest.attention import forced_path

    try:
        with forced_path(path):
            return kernels.detect_path(torch_npu) == path
    except kernels.SinkAttentionUnavailable:
        return False
