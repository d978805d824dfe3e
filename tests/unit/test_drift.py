"""Drift classification against the fingerprint table (issue 8), without upstream wheels."""

import json

from gptoss_patch import drift, matrix
from gptoss_patch.fingerprint import fingerprint_in_file

T = "vllm_ascend.attention.attention_v1:AscendAttentionBackendImpl.forward_impl"
TABLE = {"0.12.0rc1": {T: "a" * 64}, "0.13.0rc2": {T: "b" * 64}, "0.13.0": {T: "b" * 64}}


def test_fingerprint_of_a_tested_release_is_tested_code():
    d = drift.classify(T, "b" * 64, TABLE, tested={"0.12.0rc1", "0.13.0"})
    assert d.verdict == drift.TESTED and d.matches == ("0.13.0rc2", "0.13.0")
    assert "as shipped in 0.13.0" in d.text and "0.13.0rc2" not in d.text.split("in ")[-1]


def test_fingerprint_of_an_untested_release_only_is_untested_code_naming_it():
    d = drift.classify(T, "b" * 64, TABLE, tested={"0.12.0rc1"})
    assert d.verdict == drift.UNTESTED and "0.13.0rc2, 0.13.0" in d.text and "no patched cell tests" in d.text


def test_unknown_fingerprint_is_untested_code():
    d = drift.classify(T, "c" * 64, TABLE, tested={"0.12.0rc1", "0.13.0"})
    assert d.verdict == drift.UNTESTED and d.matches == () and "matches no release" in d.text
    assert "structural check" in d.text


def test_no_source_is_unknown():
    assert drift.classify(T, None, TABLE).verdict == drift.UNKNOWN


def test_the_stored_table_covers_every_target_of_every_tested_apply_row():
    table = json.loads(drift.TABLE_PATH.read_text())
    for row in matrix.ROWS:
        if row.tested and row.verdict == matrix.APPLY:
            targets = {t for t in matrix.LAYOUTS[row.layout].values() if ":" in t}
            missing = targets - set(table[row.vllm_ascend])
            assert not missing, (row.vllm_ascend, missing)


def test_fingerprint_ignores_decorators_and_sees_a_body_edit(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    @staticmethod\n    def f(x):\n        return x\n")
    before = fingerprint_in_file(src, "A.f")
    src.write_text("class A:\n    @classmethod\n    def f(x):\n        return x\n")
    from gptoss_patch import fingerprint

    fingerprint._SOURCE_CACHE.clear()
    assert fingerprint_in_file(src, "A.f") == before  # decorator excluded (reference method)
    src.write_text("class A:\n    @classmethod\n    def f(x):\n        return x + 0\n")
    fingerprint._SOURCE_CACHE.clear()
    assert fingerprint_in_file(src, "A.f") != before
    assert fingerprint_in_file(src, "A.g") is None
