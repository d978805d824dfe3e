"""Reverse drift: from each release's own sources, every upstream defect the matrix acts on is still there where a
row patches, refuses or warns about it, and absent where a row calls the capability native.

Each check reads the released ``vllm_ascend`` files (wheel, or sdist where PyPI has no cp311 wheel:
:func:`gptoss_patch_testkit.release_source.release_tree`) as text; nothing is imported. Three outcomes fail, with
different messages (the pattern of vllm-ascend-split-batch's ``test_rope_fix_drift.py``):

* the defect is gone where the row still acts on it -> "upstream fixed it: drop the patch/refusal for this row";
* the file the check reads is gone -> "the code moved: re-check the target";
* the defect is present where the row says native -> "the matrix is wrong".

The defects and their evidence (file, line) are in docs/upstream.md; the vLLM side of the MoE Enum defect
(vLLM >= 0.17 passes ``MoEActivation`` members) is checked in the cells, which install the paired vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

from gptoss_patch import matrix

NATIVE_ROWS = [r for r in matrix.ROWS if r.caps and r.version >= Version(matrix.NATIVE_FROM)]


def _text(tree: Path, rel: str) -> str:
    path = tree / rel
    if not path.is_file():
        pytest.fail(f"the code moved: {rel} is not in this release; re-check the target and this check")
    return path.read_text(encoding="utf-8")


def _function(text: str, name: str) -> str | None:
    """Source of the module- or class-level ``def name`` in ``text`` (first match), or None."""
    import ast

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    return None


def moe_string_compare(tree: Path) -> bool:
    """``unquant_apply_mlp`` compares ``activation == "swigluoai"`` with no Enum normalisation (vllm-ascend issue
    #8463; wrong with vLLM >= 0.17, whose FusedMoE passes ``MoEActivation`` members)."""
    text = _text(tree, "vllm_ascend/ops/fused_moe/moe_mlp.py")
    return (re.search(r'activation\s*==\s*"swigluoai"', text) is not None
            and 'getattr(activation, "value"' not in text and "MoEActivation.SWIGLUOAI" not in text)


def graph_drops_sinks(tree: Path) -> bool:
    """The FULL-graph attention has no ``learnable_sink`` variant (``full_graph_fia_v2``, PR #9165)."""
    return "full_graph_fia_v2" not in _text(tree, "vllm_ascend/attention/attention_v1.py")


def band_129(tree: Path) -> bool:
    """Sliding layers pass ``pre_tokens = sliding_window`` with sparse_mode 4 (129 keys), never ``window - 1``."""
    text = _text(tree, "vllm_ascend/attention/attention_v1.py")
    passes_window = re.search(r'pre_tokens"?\s*[=:]\s*self\.sliding_window\b', text) is not None
    return passes_window and "sliding_window - 1" not in text


def swa_mask(tree: Path) -> bool:
    """Sliding layers hand the band-shaped ``swa_mask`` to the sparse_mode 4 call (fixed by PR #8387)."""
    return "attn_metadata.swa_mask" in _text(tree, "vllm_ascend/attention/attention_v1.py")


def quant_moe_wrong(tree: Path) -> bool:
    """The quantized expert MLP has no swigluoai, or its grouped matmuls take no expert bias."""
    text = _text(tree, "vllm_ascend/ops/fused_moe/moe_mlp.py")
    quant = _function(text, "quant_apply_mlp")
    if quant is None:  # 0.28.0rc1+: one apply_moe_mlp; the activation through _unified_apply_activation
        unified = _function(text, "_unified_apply_activation")
        if unified is None:
            pytest.fail("the code moved: neither quant_apply_mlp nor _unified_apply_activation is in moe_mlp.py")
        no_act = "swigluoai" not in unified.lower()
    else:
        no_act = "swigluoai" not in quant.lower()
    w8a8 = sorted(tree.glob("vllm_ascend/quantization/**/w8a8_dynamic.py"))
    if not w8a8:
        pytest.fail("the code moved: no quantization/**/w8a8_dynamic.py")
    no_bias = all("w13_bias" not in p.read_text(encoding="utf-8") for p in w8a8)
    return no_act or no_bias


def p310_no_sinks(tree: Path) -> bool:
    """The 310P attention impl overrides ``forward_impl`` and never mentions sinks."""
    text = _text(tree, "vllm_ascend/_310p/attention/attention_v1.py")
    return "def forward_impl(" in text and "sink" not in text


def pa_shapes_drop_sinks(tree: Path) -> bool:
    """``forward_impl`` takes ``_npu_paged_attention`` on ``pa_shape_list`` sizes checking the window, not sinks."""
    body = _function(_text(tree, "vllm_ascend/attention/attention_v1.py"), "forward_impl")
    if body is None:
        pytest.fail("the code moved: AscendAttentionBackendImpl.forward_impl is gone; re-check this check")
    return "using_paged_attention(" in body and "self.sinks is None" not in body


def cp_no_sinks(tree: Path) -> bool:
    """With context parallelism the backend hands out a context-parallel impl with its own ``forward_impl``
    (``AscendAttentionCPImpl``; ``AscendAttentionDCPImpl`` from 0.25.1rc1) from a file that never mentions sinks."""
    backend = _text(tree, "vllm_ascend/attention/attention_v1.py")
    impl = _text(tree, "vllm_ascend/attention/context_parallel/attention_cp.py")
    selected = re.search(r"if enable_d?cp\(\):\s+from vllm_ascend\.attention\.context_parallel\.attention_cp "
                         r"import (AscendAttentionD?CPImpl)", backend)
    if selected is None:
        pytest.fail("the code moved: get_impl_cls no longer picks the context-parallel impl under enable_cp() / "
                    "enable_dcp(); re-check the target and this check")
    return f"class {selected.group(1)}(" in impl and "def forward_impl(" in impl and "sink" not in impl


#: defect check -> (capability, the row's capability states under which the defect must be present)
DEFECTS = {
    # refused where upstream's forward captures (0.19.1rc1), patched where our call is captured (layouts H, G)
    "graph_drops_sinks": (graph_drops_sinks, "attention_graph",
                          lambda cap: cap.state in (matrix.REFUSED, matrix.PATCHED)),
    # patched on every native row: our call replaces upstream's (layouts H, G), our pre_tokens upstream's (layouts I, J)
    "band_129": (band_129, "attention", lambda cap: "129 keys" in cap.note),
    "swa_mask": (swa_mask, "attention", lambda cap: "swa_mask" in cap.note),
    "quant_moe_wrong": (quant_moe_wrong, "quantized_moe", lambda cap: cap.state == matrix.REFUSED),
    "p310_no_sinks": (p310_no_sinks, "atlas_310p", lambda cap: cap.state == matrix.REFUSED),
    "pa_shapes_drop_sinks": (pa_shapes_drop_sinks, "paged_attention_shapes", lambda cap: cap.state == matrix.REFUSED),
    "cp_no_sinks": (cp_no_sinks, "context_parallel", lambda cap: cap.state == matrix.REFUSED),
}


@pytest.mark.parametrize("row", NATIVE_ROWS, ids=[r.vllm_ascend for r in NATIVE_ROWS])
@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_defect_is_present_exactly_where_the_row_acts_on_it(row, defect):
    from gptoss_patch_testkit.release_source import release_tree

    check, capability, expected_when = DEFECTS[defect]
    cap = row.caps[capability]
    present = check(release_tree(row.vllm_ascend))
    if expected_when(cap) and not present:
        pytest.fail(f"upstream fixed it: {defect} is gone from vllm-ascend {row.vllm_ascend}; drop the "
                    f"{cap.state} verdict of {capability} for this row")
    if not expected_when(cap) and present:
        pytest.fail(f"the matrix is wrong: vllm-ascend {row.vllm_ascend} still has {defect}, but the row says "
                    f"{capability} is {cap.state}")


@pytest.mark.parametrize("row", NATIVE_ROWS, ids=[r.vllm_ascend for r in NATIVE_ROWS])
def test_the_moe_string_compare_is_patched_where_vllm_passes_an_enum(row):
    """0.15/0.16 compare with the string and their vLLM passes a string (native MoE, layout H); 0.17-0.18 compare with
    the string while their vLLM passes the Enum (patched, layout G); from 0.19.1rc1 the compare handles the Enum."""
    from gptoss_patch_testkit.release_source import release_tree

    present = moe_string_compare(release_tree(row.vllm_ascend))
    enum_vllm = Version(row.vllm) >= Version("0.17")
    if row.caps["moe"].state == matrix.PATCHED:
        assert enum_vllm and row.layout == "G"
        if not present:
            pytest.fail(f"upstream fixed it: vllm-ascend {row.vllm_ascend} handles the Enum; drop moe.activation_name "
                        "for this row")
    elif present and enum_vllm:
        pytest.fail(f"the matrix is wrong: vllm-ascend {row.vllm_ascend} compares with the string while vLLM "
                    f"{row.vllm} passes MoEActivation members, but the row says moe is {row.caps['moe'].state}")


#: Every form in which ``attention_v1.py`` of vllm-ascend 0.19.1rc1 - 0.30.0rc2 mentions a layer's window (read from
#: each release; docs/upstream.md §4.3): as the fused calls' ``pre_tokens`` (directly, or through the graph parameters'
#: ``sliding_window`` and ``FIAParamProvider``), in None / truth tests, or where it is declared, stored or passed on.
#: ``attention.band_128_keys`` stores ``window - 1`` in ``self.sliding_window``; that is exact only while no other use
#: exists (a value used as a length or a cache size would then be one short).
WINDOW_USES = tuple(re.compile(p) for p in (
    r'(?<!\w)"?pre_tokens"?\s*[=:]\s*(self\.)?sliding_window( if (self\.)?sliding_window is not None else '
    r"SWA_INT_MAX)?,?$",
    r"^pre_tokens = self\.sliding_window or SWA_INT_MAX$",
    r"(self\.)?sliding_window is (not )?None",
    r"\bif (not )?(self\.)?sliding_window( else\b|:$)",  # 4 if self.sliding_window else 3; if not sliding_window:
    r"\bor not (self\.)?sliding_window:$",
    r"^sliding_window: int \| None,?$",
    r"^self\.sliding_window = sliding_window$",
    r'hf_text_config, "sliding_window"',
    r"FIAParamProvider\(self\._layer_name, self\.sliding_window,",  # 0.29.0rc1+: read only as `not self.sliding_window`
))
#: A line holding only ``(self.)sliding_window,`` is an element of the graph parameters (stored at capture, unpacked
#: by the update into a local ``sliding_window`` that the forms above cover) or ``FIAParamProvider``'s second argument
#: - known by the line before it; anywhere else (a multi-line call such as ``cdiv(self.sliding_window, ...)``) it is
#: a use this check does not know.
PASSED_ON_AFTER = ("scale,", "self.scale,", "next_tokens,", "self._layer_name,")


def window_uses_outside_pre_tokens(tree: Path) -> list[str]:
    """The lines of ``attention_v1.py`` that use ``sliding_window`` in none of the :data:`WINDOW_USES` forms, and the
    lines of the other ``vllm_ascend`` files that read an impl's window otherwise than in a None test."""
    strange, before = [], ""
    for line in _text(tree, "vllm_ascend/attention/attention_v1.py").splitlines():
        rest = line.strip()
        if re.fullmatch(r"(self\.)?sliding_window,", rest) and before in PASSED_ON_AFTER:
            rest = ""
        for pattern in WINDOW_USES:
            rest = pattern.sub("", rest)
        if "sliding_window" in rest:
            strange.append(line.strip())
        before = line.strip() or before
    for path in sorted(tree.glob("vllm_ascend/**/*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.search(r"\bimpl\.sliding_window\b(?! is (not )?None)", line):
                strange.append(f"{path.relative_to(tree)}: {line.strip()}")
    return strange


LAYOUT_I_ROWS = [r for r in matrix.ROWS if r.layout in ("I", "J")]


@pytest.mark.parametrize("row", LAYOUT_I_ROWS, ids=[r.vllm_ascend for r in LAYOUT_I_ROWS])
def test_the_window_is_only_pre_tokens_where_the_band_patch_stores_window_minus_1(row):
    """``attention.band_128_keys`` (layouts I, J) builds GPT-OSS's sliding impls with ``self.sliding_window = 127``: exact
    only if every use of the window in the release's attention impl is ``pre_tokens`` (or a None / truth test, which
    127 passes as 128 does) - checked line by line - and the band itself is still upstream's 129 keys."""
    from gptoss_patch_testkit.release_source import release_tree

    tree = release_tree(row.vllm_ascend)
    strange = window_uses_outside_pre_tokens(tree)
    if strange:
        pytest.fail(f"the code moved: vllm-ascend {row.vllm_ascend} uses the window otherwise than as pre_tokens: "
                    f"{strange}; re-check attention.band_128_keys for this row")
    assert band_129(tree), row.vllm_ascend


@pytest.mark.parametrize("use", [
    "blocks = cdiv(self.sliding_window, block_size)",
    "n = max_len or self.sliding_window",
    "max_pre_tokens = self.sliding_window",
    "blocks = cdiv(\n    self.sliding_window,\n    block_size)",
    "if self.sliding_window > 64:",
], ids=["length", "or-value", "other-name", "multi-line-argument", "comparison"])
def test_the_window_check_names_a_use_it_does_not_know(tmp_path, use):
    """Broken on purpose: a window used as a value is named (the check is not a pattern that matches anything), while
    the known forms beside it pass."""
    (tmp_path / "vllm_ascend" / "attention").mkdir(parents=True)
    known = ("pre_tokens=self.sliding_window,\nsparse_mode = 4 if self.sliding_window else 3\n"
             "            self.scale,\n            self.sliding_window,\n")
    (tmp_path / "vllm_ascend" / "attention" / "attention_v1.py").write_text(known + use + "\n")
    strange = window_uses_outside_pre_tokens(tmp_path)
    assert len(strange) == 1 and "sliding_window" in strange[0], strange


def test_the_window_check_reads_an_impls_window_in_other_files(tmp_path):
    (tmp_path / "vllm_ascend" / "attention").mkdir(parents=True)
    (tmp_path / "vllm_ascend" / "attention" / "attention_v1.py").write_text("pre_tokens=self.sliding_window,\n")
    (tmp_path / "vllm_ascend" / "attention" / "utils.py").write_text(
        "ok = impl.sliding_window is None\nsize = impl.sliding_window + 1\n")
    assert window_uses_outside_pre_tokens(tmp_path) == ["vllm_ascend/attention/utils.py: size = impl.sliding_window + 1"]
