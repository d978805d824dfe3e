"""The version-matrix decision (issue 2 acceptance: 0.11.0, a local build, 0.15.0rc1, 0.23.0, 0.10.2rc1,
0.11.0rc0, unparsable versions, vllm-ascend missing, vllm missing)."""

import pytest

from gptoss_patch import matrix

#: Every table a new vllm-ascend release touches, in order (``docs/adding-a-release.md`` explains each step):
#: ``(file, name)``; test_the_release_checklist_names_what_exists checks that each name exists in its file. The release
#: facts live beside the rows (gptoss_patch/matrix.py); this checklist is the tests'.
RELEASE_CHECKLIST: tuple[tuple[str, str], ...] = (
    ("gptoss_patch/matrix.py", "ROWS"),
    ("gptoss_patch/matrix.py", "LAYOUTS"),
    ("gptoss_patch/matrix.py", "LAYOUT_PATCHES"),
    ("gptoss_patch/matrix.py", "VLLM_RELIED"),
    ("gptoss_patch/matrix.py", "NZ_RULES"),
    ("noxfile.py", "CELLS"),
    ("testkit/gptoss_patch_testkit/jobs/runner.py", "RUNNER_RULES"),
    ("gptoss_patch/upstream_fingerprints.json", "scripts/update_fingerprints.py"),
    ("tests/unit/test_reverse_drift.py", "DEFECTS"),
    ("docs/version-matrix.md", "# Version matrix"),
    ("docs/upstream.md", "# "),
)

from gptoss_patch.matrix import APPLY, REFUSE, STAND_DOWN, decide


def compatible(row):
    return []


def incompatible(row):
    return ["vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.__init__ does not accept **kwargs"]


def test_tested_release_applies_exactly():
    d = decide("0.11.0", "0.11.0", structural_check=incompatible)  # the check is not consulted for an exact row
    assert d.verdict == APPLY and d.exact and d.row.vllm_ascend == "0.11.0"
    assert "tested release" in d.reason


def test_local_build_maps_to_nearest_tested_row_when_structurally_compatible():
    d = decide("0.11.0rc1.dev449+gc9b64052e", "0.11.3.dev0+g275de3417", structural_check=compatible)
    assert d.verdict == APPLY and not d.exact
    assert d.row.vllm_ascend == "0.11.0"
    assert "untested build" in d.reason and "structurally compatible with 0.11.0" in d.reason


def test_local_build_refused_when_a_target_differs():
    d = decide("0.11.0rc1.dev449+gc9b64052e", "0.11.3.dev0+g275de3417", structural_check=incompatible)
    assert d.verdict == REFUSE
    assert "structurally different from 0.11.0" in d.reason and "**kwargs" in d.reason
    assert d.structural_failures


def test_local_build_without_a_structural_check_is_refused():
    d = decide("0.11.0rc1.dev449+gc9b64052e", "0.11.3.dev0+g275de3417")
    assert d.verdict == REFUSE and "not checked" in d.reason


def test_unpaired_vllm_needs_the_structural_check():
    d = decide("0.11.0", "0.12.0", structural_check=compatible)
    assert d.verdict == APPLY and not d.exact and "tested pairing: vllm 0.11.0" in d.reason
    assert decide("0.11.0", "0.12.0", structural_check=incompatible).verdict == REFUSE


def _standing_down(release: str = "0.19.1rc1") -> tuple[matrix.Row, ...]:
    """The table with ``release`` as a *stand-down* row - what a release whose native GPT-OSS needs no patch would
    be (none does today: every native release admits 129 keys, layouts I and J; the verdict stays for the day one
    does)."""
    import dataclasses

    return tuple(dataclasses.replace(r, verdict=STAND_DOWN, layout=None,
                                     caps={**r.caps, "attention": matrix.Cap(matrix.NATIVE)})
                 if r.vllm_ascend == release else r for r in matrix.ROWS)


@pytest.mark.parametrize("va,vv", [("0.19.1rc1", "0.19.1")])
def test_native_releases_stand_down_but_never_say_the_patch_is_not_needed(va, vv):
    d = decide(va, vv, rows=_standing_down(va))
    assert d.verdict == STAND_DOWN and d.row.vllm_ascend == va
    assert "supports GPT-OSS natively" in d.reason and "no longer need" not in d.reason
    assert "the guard refuses what is still wrong upstream" in d.reason


@pytest.mark.parametrize("va", ["0.15.0rc1", "0.16.0rc1", "0.17.0rc1", "0.18.0rc1", "0.18.0"])
def test_015_to_018_apply_their_sliding_window_attention_patch(va):
    """0.15.0rc1 - 0.18.0 hand their sliding layers swa_mask with sparse_mode 4 and a 129-key band: layout H patches
    the attention; layout G (vLLM 0.17/0.18 pass MoEActivation.SWIGLUOAI, vllm-ascend compares with the string) the
    MoE activation too."""
    row = next(r for r in matrix.ROWS if r.vllm_ascend == va)
    d = decide(va, row.vllm, structural_check=compatible)
    layout = "H" if va < "0.17" else "G"
    assert d.verdict == APPLY and d.row.layout == layout and matrix.native_sinks(d.row)
    assert not matrix.native_attention(d.row)
    assert matrix.LAYOUT_PATCHES["H"] == ("attention.sink_window_forward_impl", "attention_graph.update_graph_params")
    assert matrix.LAYOUT_PATCHES["G"] == ("attention.sink_window_forward_impl", "attention_graph.update_graph_params",
                                          "moe.activation_name")
    att = d.row.caps["attention"]
    assert att.state == matrix.PATCHED and "swa_mask" in att.note and "129 keys" in att.note
    # FULL_DECODE_ONLY: upstream's capture drops the sinks until PR #9165; our call is captured and updated instead
    graph = d.row.caps["attention_graph"]
    assert graph.state == matrix.PATCHED and "PR #9165" in graph.note
    moe = d.row.caps["moe"]
    assert (moe.state, "#8463" in moe.note) == ((matrix.PATCHED, True) if layout == "G" else (matrix.NATIVE, False))
    # an untested row, or a tested one with another vLLM build, applies only after the structural check
    other_vllm = row.vllm if not row.tested else row.vllm + ".post1"
    assert decide(va, other_vllm, structural_check=incompatible).verdict == REFUSE


def test_every_row_has_every_capability_and_its_verdict_follows_from_them():
    for row in matrix.ROWS:
        if row.verdict == REFUSE:
            assert not row.caps, row
            continue
        assert set(row.caps) == set(matrix.CAPABILITIES), row.vllm_ascend
        states = {c.state for c in row.caps.values()}
        assert states <= {matrix.NATIVE, matrix.PATCHED, matrix.DEVIATES, matrix.REFUSED}
        # apply <=> something of the layout is patched; a patched capability needs a layout with patches. Except the
        # MXFP4 checkpoint: its patches are vLLM-side (matrix.MXFP4_TARGETS), registered on stand-down rows too
        layout_states = {c.state for name, c in row.caps.items() if name != "checkpoint_mxfp4"}
        assert (row.verdict == APPLY) == (matrix.PATCHED in layout_states), row.vllm_ascend
        for cap in row.caps.values():
            assert cap.state == matrix.NATIVE or cap.note, (row.vllm_ascend, cap)


def test_native_rows_list_what_is_still_wrong_upstream_in_that_release():
    early = decide("0.15.0rc1", "0.15.0", structural_check=compatible).gaps
    late = decide("0.19.1rc1", "0.19.1").gaps
    assert any(g.startswith("attention_graph: patched") and "PR #9165" in g for g in early)
    assert any(g.startswith("attention_graph: patched") and "full_graph_fia" in g for g in late)
    assert any(g.startswith("quantized_moe: refused") for g in late)
    assert any(g.startswith("attention: patched") and "129 keys" in g and "pre_tokens 127" in g for g in late)
    assert not any(g.startswith("moe:") for g in early + late)  # native MoE


@pytest.mark.parametrize("row", [r for r in matrix.ROWS if r.version >= matrix.Version("0.19.1rc1")],
                         ids=lambda r: r.vllm_ascend)
def test_every_release_from_0191rc1_applies_the_128_key_band(row):
    """Issue 30: every native release hands its sliding layers pre_tokens = 128 (129 keys); from 0.19.1rc1 on nothing
    else of its forward is ours, so the band is the one patch of layout J, and on 0.19.1rc1 (layout I) the other two
    capture the sink layers for FULL_DECODE_ONLY graphs, which its forward captures without sinks (PR #9165 came in
    0.20.2rc1) - and no release is left *deviates*."""
    assert row.verdict == APPLY and row.layout == ("I" if row.vllm_ascend == "0.19.1rc1" else "J")
    assert matrix.LAYOUT_PATCHES["I"] == ("attention.band_128_keys", "attention_graph.capture_sinks",
                                          "attention_graph.update_graph_params")
    assert matrix.LAYOUT_PATCHES["J"] == ("attention.band_128_keys",)
    assert row.caps["attention_graph"].state == (matrix.PATCHED if row.layout == "I" else matrix.NATIVE)
    assert row.caps["attention"].state == matrix.PATCHED and matrix.native_attention(row)
    assert matrix.DEVIATES not in {c.state for c in row.caps.values()}


def test_a_release_newer_than_the_table_is_refused_not_assumed_native():
    newest = matrix.newest_row()
    d = decide("9.0.0", "9.0.0", structural_check=compatible)
    assert d.verdict == REFUSE and f"newest release this gptoss-patch has checked ({newest.vllm_ascend})" in d.reason
    assert "GPTOSS_PATCH_ALLOW_UNPATCHED" in d.reason


def test_a_native_release_with_another_vllm_is_refused_naming_the_pair():
    rows = _standing_down()
    d = decide("0.19.1rc1", "0.20.2", structural_check=compatible, rows=rows)
    assert d.verdict == REFUSE and "pairs with vllm 0.19.1, not 0.20.2" in d.reason
    forced = decide("0.19.1rc1", "0.20.2", force=True, rows=rows)
    assert forced.verdict == STAND_DOWN and forced.forced


def test_layout_i_with_another_vllm_takes_the_structural_check():
    d = decide("0.19.1rc1", "0.20.2", structural_check=compatible)
    assert d.verdict == APPLY and not d.exact and "structurally compatible with 0.19.1rc1" in d.reason
    assert decide("0.19.1rc1", "0.20.2", structural_check=incompatible).verdict == REFUSE


def test_layout_h_with_another_vllm_takes_the_structural_check():
    """0.16.0rc1 (layout H) with vLLM 0.17.0 is an untested pairing: applied only when both sides pass the structural
    check (at activation, :func:`gptoss_patch.pairing.judge` also refuses it when that vLLM passes the MoE
    activation as the Enum upstream's string compare misses: tests/cell/native_015 shows it on the real wheels)."""
    d = decide("0.16.0rc1", "0.17.0", structural_check=compatible)
    assert d.verdict == APPLY and "untested build" in d.reason and d.row.layout == "H"
    assert decide("0.16.0rc1", "0.17.0", structural_check=incompatible).verdict == REFUSE


@pytest.mark.parametrize("va,vv,row", [("0.11.0+empty", "0.11.0+empty", "0.11.0"), ("0.14.0rc1", "0.14.1+cpu", "0.14.0rc1"),
                                       ("0.13.0+ascend.a3", "0.13.0", "0.13.0")])
def test_a_local_label_is_the_public_release_it_labels(va, vv, row):
    """Official images install vLLM as X.Y.Z+empty: that is release X.Y.Z, a tested pairing."""
    d = decide(va, vv, structural_check=incompatible)  # exact: the structural check is not consulted
    assert d.verdict == APPLY and d.exact and d.row.vllm_ascend == row


def test_a_tagless_source_build_is_refused_naming_the_way_out():
    d = decide("0.11.0", "0.1.dev1+g1234abc", structural_check=compatible)
    assert d.verdict == REFUSE and "without release tags" in d.reason
    assert "VLLM_VERSION" in d.reason and "GPTOSS_PATCH_FORCE" in d.reason


def test_older_series_is_refused_naming_the_supported_releases():
    d = decide("0.10.2rc1", "0.10.2", structural_check=compatible)
    assert d.verdict == REFUSE
    assert "vllm-ascend 0.11.0 with vllm 0.11.0" in d.reason and "vllm-ascend 0.15.0rc1 with vllm 0.15.0" in d.reason
    assert "vllm-ascend 0.19.1rc1 with vllm 0.19.1" in d.reason and "nothing to patch" not in d.reason


def test_rc0_is_refused_as_a_different_architecture_even_if_checks_pass():
    d = decide("0.11.0rc0", "0.11.0", structural_check=compatible)
    assert d.verdict == REFUSE and "different architecture" in d.reason


@pytest.mark.parametrize("va,vv,name", [("banana", "0.11.0", "vllm-ascend"), ("0.11.0", "not-a-version", "vllm")])
def test_unparsable_versions_are_refused_naming_the_string(va, vv, name):
    d = decide(va, vv, structural_check=compatible)
    assert d.verdict == REFUSE
    assert name in d.reason and "PEP 440" in d.reason


def test_vllm_ascend_missing():
    d = decide(None, "0.11.0")
    assert d.verdict == REFUSE and "vllm-ascend is not installed" in d.reason


def test_vllm_missing():
    d = decide("0.11.0", None)
    assert d.verdict == REFUSE and "vllm is not installed" in d.reason


def test_force_applies_the_nearest_row_and_says_so():
    d = decide("0.11.0rc1.dev449+gc9b64052e", "0.11.3.dev0", force=True, structural_check=incompatible)
    assert d.verdict == APPLY and d.forced and d.row.vllm_ascend == "0.11.0"
    assert d.reason.startswith("FORCED by GPTOSS_PATCH_FORCE=1")
    assert d.structural_failures


def test_force_never_overrides_stand_down():
    d = decide("0.19.1rc1", "0.19.1", force=True, rows=_standing_down())
    assert d.verdict == STAND_DOWN and not d.forced


def test_table_comes_from_the_rows():
    rows = matrix.table()
    assert [r["vllm-ascend"] for r in rows][:len(matrix.ROWS)] == sorted(
        (r.vllm_ascend for r in matrix.ROWS), key=lambda v: matrix.Version(v))
    assert rows[-1]["verdict"] == REFUSE and rows[-1]["vllm-ascend"] == f"> {matrix.newest_row().vllm_ascend}"


def test_every_layout_patch_is_declared_and_targets_exist_in_the_layout():
    from gptoss_patch.patches import all_specs

    specs = all_specs()
    for layout, names in matrix.LAYOUT_PATCHES.items():
        for name in names:
            assert name in specs, f"layout {layout} needs undeclared patch {name}"
            assert specs[name].target_key in matrix.LAYOUTS[layout]


@pytest.mark.parametrize("va,vv,layout", [("0.11.0", "0.11.0", "B"), ("0.12.0rc1", "0.12.0", "C"),
                                          ("0.13.0", "0.13.0", "E"), ("0.14.0rc1", "0.14.1", "F")])
def test_every_tested_row_applies_exactly_with_its_paired_vllm(va, vv, layout):
    d = decide(va, vv, structural_check=incompatible)  # exact tested pairing: the check is not consulted
    assert d.verdict == APPLY and d.exact and d.row.vllm_ascend == va and d.row.layout == layout
    assert d.row.tested


def test_014_with_the_other_014_vllm_is_judged_by_structure():
    # vllm-ascend 0.14.0rc1 pairs with vLLM 0.14.1 (versioning policy); 0.14.0 is another build
    assert decide("0.14.0rc1", "0.14.0", structural_check=compatible).verdict == APPLY
    d = decide("0.14.0rc1", "0.14.0", structural_check=incompatible)
    assert d.verdict == REFUSE and "tested pairing: vllm 0.14.1" in d.reason


@pytest.mark.parametrize("va,vv,judged_as", [("0.11.0rc1", "0.11.0", "0.11.0"), ("0.11.0rc2", "0.11.0", "0.11.0"),
                                             ("0.11.0rc3", "0.11.0", "0.11.0"), ("0.13.0rc1", "0.13.0", "0.13.0"),
                                             ("0.13.0rc2", "0.13.0", "0.13.0")])
def test_untested_rows_apply_only_through_the_structural_check_of_a_tested_row(va, vv, judged_as):
    ok = decide(va, vv, structural_check=compatible)
    assert ok.verdict == APPLY and not ok.exact and ok.row.vllm_ascend == judged_as
    assert f"structurally compatible with {judged_as}" in ok.reason
    bad = decide(va, vv, structural_check=incompatible)
    assert bad.verdict == REFUSE and f"structurally different from {judged_as}" in bad.reason
    assert decide(va, vv).verdict == REFUSE  # no check, no apply


def test_013rc3_is_refused_as_a_separate_untested_build_even_if_checks_pass():
    d = decide("0.13.0rc3", "0.13.0", structural_check=compatible)
    assert d.verdict == REFUSE
    assert "separate build" in d.reason and "no cell tests" in d.reason
    assert "vllm-ascend 0.13.0 with vllm 0.13.0" in d.reason  # names what is supported


def test_every_tested_apply_row_has_a_layout_with_patches():
    for row in matrix.ROWS:
        if row.verdict == APPLY:
            assert row.layout in matrix.LAYOUTS and matrix.LAYOUT_PATCHES[row.layout], row


@pytest.mark.parametrize("va,vv", [("0.13.0rc3+local", "0.13.0"), ("0.13.0rc3.post1", "0.13.0"),
                                   ("0.13.0rc3.dev7", "0.13.0"), ("0.11.0rc0+g1234", "0.11.0")])
def test_local_post_and_dev_builds_of_a_refused_release_are_refused_too(va, vv):
    d = decide(va, vv, structural_check=compatible)  # even when every target would pass the check
    assert d.verdict == REFUSE and d.row is not None and d.row.verdict == REFUSE
    assert d.row.note in d.reason


def test_other_pre_releases_of_a_refused_series_are_not_caught_by_the_refused_row():
    d = decide("0.13.0rc4.dev1", "0.13.0", structural_check=compatible)
    assert d.verdict == APPLY and "structurally compatible with 0.13.0" in d.reason


def test_0191rc1_lists_exactly_the_remaining_native_gaps():
    d = decide("0.19.1rc1", "0.19.1")
    assert [g.split(":")[0] for g in d.gaps] == ["attention", "attention_graph", "quantized_moe", "checkpoint_mxfp4",
                                                 "atlas_310p", "paged_attention_shapes", "context_parallel",
                                                 "model_runner_v2"]
    assert d.gaps[0].startswith("attention: patched") and "swa_mask" not in d.gaps[0]  # PR #8387 is in 0.19.1rc1
    assert d.gaps[1].startswith("attention_graph: patched") and "PR #9165" in d.gaps[1]


def test_the_release_checklist_names_what_exists():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path, name in RELEASE_CHECKLIST:
        if path.endswith(".json"):
            assert (root / path).is_file() and (root / name).is_file(), (path, name)
            continue
        assert name in (root / path).read_text(encoding="utf-8"), (path, name)


@pytest.mark.parametrize("va", ["0.23.1rc1", "0.20.0", "0.10.2rc1"])
def test_force_never_borrows_the_layout_of_another_series(va):
    d = decide(va, "0.23.0", force=True, structural_check=compatible)
    assert d.verdict == REFUSE and not d.forced, d


def test_native_pairing_rules_name_what_exists():
    """Each per-release pairing rule (row data, read by gptoss_patch.pairing) names a declared patch, a layout that
    holds its target and a trigger the pairing module knows."""
    from gptoss_patch import pairing
    from gptoss_patch.patches import all_specs

    assert matrix.NATIVE_PAIRING_RULES
    for rule in matrix.NATIVE_PAIRING_RULES:
        spec = all_specs()[rule.patch]
        assert spec.target_key in matrix.LAYOUTS[rule.layout]
        assert rule.trigger in pairing._TRIGGERS and "{target}" in rule.problem
