"""``checkpoint_bf16.ep_expert_range`` (gptoss_patch/patches/checkpoint_bf16.py; docs/upstream.md §4.12): the wrapper puts a
reversed expert range back in order and passes every other call through unchanged. Through vLLM 0.11.0's real loader:
tests/cell/test_serve_more.py (EP 2 serves transformers' tokens; unpatched it does not load) and test_mxfp4.py."""


import pytest

from gptoss_patch import matrix
from gptoss_patch.patches import checkpoint_bf16 as expert_parallel  # capability checkpoint_bf16
from gptoss_patch.registry import static_check


def _loader(self, ep_rank_start: int, ep_rank_end: int, heads_per_rank: int, head_start: int, weights, mapping):
    """vLLM 0.11.0's ``_load_weights_other`` signature; returns what it would slice."""
    return list(range(8))[ep_rank_start:ep_rank_end], heads_per_rank, head_start, weights, mapping


def _call(*args, **kwargs):
    import functools

    wrapped = functools.partial(_loader, None)
    wrapped.__signature__ = __import__("inspect").signature(lambda ep_rank_start, ep_rank_end, heads_per_rank,
                                                            head_start, weights, mapping: None)
    return expert_parallel.PATCHES[0].wrapper(wrapped, None, args, kwargs)


@pytest.mark.parametrize("start,end,experts", [(4, 0, [0, 1, 2, 3]), (8, 4, [4, 5, 6, 7]), (0, 4, [0, 1, 2, 3]),
                                               (4, 8, [4, 5, 6, 7]), (3, 3, [])])
def test_range_in_order(start, end, experts):
    # vLLM 0.11.0 calls _load_weights_other(ep_rank_end, ep_rank_start, ...): start > end reaches the loader
    assert _call(start, end, 4, 0, "w", "m") == (experts, 4, 0, "w", "m")
    assert _call(ep_rank_start=start, ep_rank_end=end, heads_per_rank=4, head_start=0, weights="w",
                 mapping="m")[0] == experts
    assert expert_parallel.ordered_expert_range(start, end) == (min(start, end), max(start, end))


def test_applied_only_where_the_loader_is_declared_start_first(tmp_path, monkeypatch):
    spec = expert_parallel.PATCHES[0]
    pkg = tmp_path / "fakevllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "        return None\n"
    (pkg / "v011.py").write_text("class GptOssModel:\n    def _load_weights_other(\n        self,\n"
                                 "        ep_rank_start: int,\n        ep_rank_end: int,\n        heads_per_rank: int,\n"
                                 "        head_start: int,\n        weights,\n        stacked_params_mapping,\n"
                                 "    ) -> set:\n" + body)
    (pkg / "v012.py").write_text("class GptOssModel:\n    def _load_weights_other(\n        self,\n"
                                 "        ep_rank_end: int,\n        ep_rank_start: int,\n        heads_per_rank: int,\n"
                                 "        head_start: int,\n        weights,\n        stacked_params_mapping,\n"
                                 "    ) -> set:\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert static_check(spec, "fakevllm.v011:GptOssModel._load_weights_other") == []
    problems = static_check(spec, "fakevllm.v012:GptOssModel._load_weights_other")
    assert problems and "no longer contains" in problems[0]


def test_registered_for_the_rows_paired_with_vllm_0_11_0_only():
    for row in matrix.ROWS:
        patched = row.caps.get("checkpoint_bf16") is not None and row.caps["checkpoint_bf16"].state == matrix.PATCHED
        assert patched == (row.vllm == "0.11.0" and row.verdict == matrix.APPLY), row.vllm_ascend
