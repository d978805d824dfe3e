"""The version matrix: one declarative table of upstream releases, and :func:`decide`.

Every fact here was read from the released wheels (``pip download --no-deps vllm-ascend==X``) and
from ``shared/reference/upstream_targets.md`` §1 (pairing, torch-npu pins, CANN) and §3 (where each
target lives); a row is ``tested`` only when a ``nox`` cell ``cell-<release>`` runs the suite
against that release's real wheels.

Three verdicts:

* ``apply``: a supported release without native GPT-OSS support; our patches are registered.
* ``stand-down``: vllm-ascend >= 0.15.0rc1 supports GPT-OSS natively; nothing is patched and
  :mod:`gptoss_patch.verify` tells the user which GPT-OSS gaps remain upstream in that release.
* ``refuse``: unknown, unparsable or structurally different; nothing is patched, and building a
  GPT-OSS model stops with an error (the guard), so a server never emits garbage.

A build that is not a row (a pre-release or local build such as ``0.11.0rc1.dev449+gc9b64052e``,
or a vLLM that is not the paired one) maps to the nearest tested row of the same ``major.minor``
series, but only when every target passes the structural check for that row's layout; the
reason then says "untested build, structurally compatible with X". ``GPTOSS_PATCH_FORCE=1``
applies the nearest row anyway (loudly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from packaging.version import InvalidVersion, Version

APPLY = "apply"
STAND_DOWN = "stand-down"
REFUSE = "refuse"

# ---------------------------------------------------------------------------------------------
# Where each patch target lives, per module-layout family (upstream_targets.md §3).
# A "target key" names a place our patches hook; the value is "module:qualname".
# ---------------------------------------------------------------------------------------------

_AA = "vllm_ascend.attention.attention_v1"
_AG = "vllm_ascend.compilation.acl_graph"
_MR = "vllm_ascend.worker.model_runner_v1"
_FM = "vllm_ascend.ops.fused_moe"  # 0.12.0rc1+ (ops/moe -> ops/fused_moe, §3.3)
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
    # B = vllm-ascend 0.11.0rc1, rc2, rc3, 0.11.0 (identical module layout; §3)
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
}

#: Which patches (by name, see gptoss_patch.patches) each layout family needs. One name per line: each
#: capability module owns its own lines.
LAYOUT_PATCHES: dict[str, tuple[str, ...]] = {
    "B": (
        "attention.keep_sinks",
        "attention.sink_window_forward",
        "rope.yarn_truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp",
        "aclgraph.update_attn_params",
        "weights.pad_moe_intermediate",
    ),
    "C": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "rope.yarn_truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "aclgraph.update_attn_params",
        "weights.pad_moe_intermediate",
    ),
    "E": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "rope.yarn_truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "aclgraph.update_attn_params_013",
        "weights.pad_moe_intermediate",
    ),
    "F": (
        "attention.keep_sinks",
        "attention.sink_window_forward_impl",
        "rope.yarn_truncate",
        "moe.unquant_apply",
        "moe.fused_experts",
        "moe.apply_mlp_012",
        "aclgraph.update_graph_params",
        "weights.pad_moe_intermediate",
    ),
}


@dataclass(frozen=True)
class Gap:
    """A GPT-OSS gap that remains in a natively supporting release, and the release that closed it."""

    text: str
    fixed_in: str | None  # vllm-ascend release that fixes it upstream; None = open upstream


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

    @property
    def version(self) -> Version:
        """The vllm-ascend release as a :class:`packaging.version.Version`."""
        return Version(self.vllm_ascend)


#: The table. Order does not matter; :func:`decide` sorts by version.
ROWS: tuple[Row, ...] = (
    Row("0.11.0rc0", "0.11.0rc3", "2.7.1", "2.7.1.dev20250724", "8.2.RC1", REFUSE, None, False,
        "different architecture (Attention class replaced wholesale, MoE method monkey-patched onto vLLM's)"),
    Row("0.11.0rc1", "0.11.0", "2.7.1", "2.7.1", "8.3.RC1", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)"),
    Row("0.11.0rc2", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)"),
    Row("0.11.0rc3", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", False,
        "same layout as 0.11.0 (every target passes the structural check, read from the wheel)"),
    Row("0.11.0", "0.11.0", "2.7.1", "2.7.1", "8.3.RC2", APPLY, "B", True,
        "GPT-OSS patches applied (see verify for the list)"),
    Row("0.12.0rc1", "0.12.0", "2.8.0", "2.8.0", "8.3.RC2", APPLY, "C", True,
        "GPT-OSS patches applied (see verify for the list)"),
    Row("0.13.0rc1", "0.13.0", "2.8.0", "2.8.0", "8.3.RC2", APPLY, "E", False,
        "judged against 0.13.0 (every target passes the structural check, read from the wheel)"),
    Row("0.13.0rc2", "0.13.0", "2.8.0", "2.8.0", "8.5.0", APPLY, "E", False,
        "judged against 0.13.0 (every target passes the structural check, read from the wheel)"),
    Row("0.13.0rc3", "0.13.0", "2.8.0", "2.8.0.post2", "8.5.1", REFUSE, None, False,
        "a separate build released after 0.13.0 (DeepSeek-V4 code; its MoE apply differs from 0.13.0's) "
        "that no cell tests"),
    Row("0.13.0", "0.13.0", "2.8.0", "2.8.0.post2", "8.5.0", APPLY, "E", True,
        "GPT-OSS patches applied (see verify for the list)"),
    Row("0.14.0rc1", "0.14.1", "2.9.0", "2.9.0", "8.5.0", APPLY, "F", True,
        "GPT-OSS patches applied (see verify for the list)"),
    Row("0.15.0rc1", "0.15.0", "2.9.0", "2.9.0", "8.5.0", STAND_DOWN, None, True,
        "native GPT-OSS support; calibration cell"),
)

#: From this vllm-ascend release on, GPT-OSS is supported natively (commit 7221045777, PR #5901).
NATIVE_FROM = "0.15.0rc1"

#: What natively supporting releases still get wrong for GPT-OSS (upstream_targets.md §7, npu_ops.md §10).
NATIVE_GAPS: tuple[Gap, ...] = (
    Gap("sliding-window layers use a swa_mask that violates the sparse_mode=4 mask constraint "
        "(upstream fix e15d766aba, PR #8387)", "0.19.1rc1"),
    Gap("FULL_DECODE_ONLY ACL graphs capture GPT-OSS attention without sinks or window; use PIECEWISE "
        "(upstream fix 8da8e0e6db, PR #9165)", "0.20.2rc1"),
    Gap("the TND band (sparse_mode=4, pre_tokens=sliding_window) admits 129 keys where the model "
        "attends 128 (npu_ops.md §10.1)", None),
    Gap("with additional_config.pa_shape_list in FULL_DECODE_ONLY mode, full-attention layers take "
        "_npu_paged_attention, which ignores sinks (npu_ops.md §10.4)", None),
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
        gaps: for stand-down, the upstream GPT-OSS gaps still open in that release.
        structural_failures: for an untested build, the targets that failed the structural check.
    """

    verdict: str
    reason: str
    row: Row | None = None
    exact: bool = False
    forced: bool = False
    gaps: tuple[Gap, ...] = ()
    structural_failures: tuple[str, ...] = field(default_factory=tuple)


def _parse(name: str, raw: str | None) -> Version | None:
    if raw is None:
        return None
    try:
        return Version(raw)
    except InvalidVersion:
        raise ValueError(f"{name} version {raw!r} is not a PEP 440 version") from None


def supported_releases(rows: Sequence[Row] = ROWS) -> list[str]:
    """The vllm-ascend releases with verdict *apply*, oldest first."""
    return [r.vllm_ascend for r in sorted(rows, key=lambda r: r.version) if r.verdict == APPLY]


def _supported_text(rows: Sequence[Row]) -> str:
    pairs = [f"vllm-ascend {r.vllm_ascend} with vllm {r.vllm}" for r in sorted(rows, key=lambda r: r.version)
             if r.verdict == APPLY]
    return "; ".join(pairs) + f"; vllm-ascend >= {NATIVE_FROM} needs no patch"


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


def gaps_for(version: Version) -> tuple[Gap, ...]:
    """GPT-OSS gaps still open upstream in natively supporting release ``version``."""
    return tuple(g for g in NATIVE_GAPS if g.fixed_in is None or version < Version(g.fixed_in))


def decide(
    vllm_ascend: str | None,
    vllm: str | None,
    *,
    force: bool = False,
    structural_check: Callable[[Row], Sequence[str]] | None = None,
    rows: Sequence[Row] = ROWS,
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

    if va >= Version(NATIVE_FROM):
        gaps = gaps_for(va)
        text = (f"vllm-ascend {vllm_ascend} supports GPT-OSS natively (since {NATIVE_FROM}); gptoss-patch "
                "stands down and patches nothing - you no longer need it")
        return Decision(STAND_DOWN, text, gaps=gaps)

    if vv is None:
        return Decision(REFUSE, f"vllm is not installed next to vllm-ascend {vllm_ascend}; install the paired "
                                f"vllm ({_supported_text(rows)})")

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
    if row is not None and row.verdict == APPLY and row.tested and row.vllm is not None and Version(row.vllm) == vv:
        return Decision(APPLY, f"vllm-ascend {vllm_ascend} with vllm {vllm} is a tested release", row, exact=True)

    candidate = row if (row is not None and row.verdict == APPLY and row.tested) else nearest_tested(va, rows)
    if candidate is None:
        reason = (f"vllm-ascend {vllm_ascend} (vllm {vllm}) is not in the version matrix and no tested "
                  f"release of its series exists. Supported: {_supported_text(rows)}")
        return _maybe_force(Decision(REFUSE, reason), force, rows, va)

    what = (f"vllm-ascend {vllm_ascend} with vllm {vllm}" if row is None
            else f"vllm-ascend {vllm_ascend} with vllm {vllm} (tested pairing: vllm {candidate.vllm})")
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
    row = decision.row if (decision.row is not None and decision.row.verdict == APPLY) else None
    if row is None:
        row = nearest_tested(va, rows)
    if row is None:
        applies = sorted((r for r in rows if r.verdict == APPLY and r.tested), key=lambda r: r.version)
        row = applies[-1] if applies else None
    if row is None:
        return decision
    return Decision(APPLY, f"FORCED by GPTOSS_PATCH_FORCE=1 using the {row.vllm_ascend} layout; "
                           f"would otherwise refuse: {decision.reason}", row, forced=True,
                    structural_failures=decision.structural_failures)


def table(rows: Sequence[Row] = ROWS) -> list[Mapping[str, str]]:
    """The matrix as rows of strings for ``verify --matrix`` and the README (release, paired vllm, torch /
    torch-npu, CANN, verdict, layout family, tested, note)."""
    out = []
    for r in sorted(rows, key=lambda r: r.version):
        out.append({"vllm-ascend": r.vllm_ascend, "vllm": r.vllm or "-", "torch / torch-npu": f"{r.torch} / {r.torch_npu}",
                    "CANN": r.cann, "verdict": r.verdict, "layout": r.layout or "-",
                    "tested": f"yes (cell-{r.vllm_ascend})" if r.tested else "no", "note": r.note})
    out.append({"vllm-ascend": f">= {NATIVE_FROM}", "vllm": "paired", "torch / torch-npu": "as pinned", "CANN": "as pinned",
                "verdict": STAND_DOWN, "layout": "-", "tested": "no", "note": "native GPT-OSS support upstream"})
    return out


def markdown(rows: Sequence[Row] = ROWS) -> str:
    """The matrix as the Markdown table the README shows (tested by ``tests/unit/test_readme.py``)."""
    cols = ["vllm-ascend", "vllm", "torch / torch-npu", "CANN", "verdict", "layout", "tested", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table(rows):
        lines.append("| " + " | ".join(r[c] for c in cols) + " |")
    return "\n".join(lines)
