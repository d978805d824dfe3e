"""Which refused capabilities a configuration uses (:func:`gptoss_patch.patches.guard.refused_in_use`).

The configurations are plain attribute holders with the fields vLLM's ``VllmConfig`` has
(``model_config.quantization`` / ``enforce_eager``, ``compilation_config.cudagraph_mode``, ``additional_config``);
the cells build real ``VllmConfig`` objects (tests/cell/native_015/test_native_guard.py). The row capabilities are
the matrix's own (0.15.0rc1, 0.24.0rc1, ...), or one of them with a capability refused.
"""

from types import SimpleNamespace

import pytest

from gptoss_patch import matrix
from gptoss_patch.patches.guard import refused_in_use


def caps(release):
    row = next(r for r in matrix.ROWS if r.vllm_ascend == release)
    return {name: {"state": cap.state, "note": cap.note} for name, cap in row.caps.items()}


def config(mode="PIECEWISE", quantization=None, eager=False, pa=None, pcp=1, dcp=1):
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization, enforce_eager=eager),
                           compilation_config=SimpleNamespace(cudagraph_mode=mode),
                           additional_config={"pa_shape_list": pa} if pa else {}, quant_config=None,
                           parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp,
                                                           decode_context_parallel_size=dcp))


def names(lines):
    return [line.split(":")[0] for line in lines]


def graph_refused(release="0.15.0rc1"):
    """``release``'s capabilities with ``attention_graph`` refused, as on 0.15.0rc1 - 0.19.1rc1 before issue 30
    patched their capture (a row whose graph capture drops the sinks and that nothing patches)."""
    return {**caps(release), "attention_graph": {"state": matrix.REFUSED, "note": "full_graph_fia drops the sinks"}}


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE"])
def test_full_decode_graphs_are_refused_where_the_capture_drops_the_sinks(mode):
    assert names(refused_in_use(graph_refused(), config(mode))) == ["attention_graph"]
    assert refused_in_use(caps("0.15.0rc1"), config(mode)) == []  # patched there (layout H)


def test_piecewise_and_eager_are_not_refused():
    assert refused_in_use(graph_refused(), config("PIECEWISE")) == []
    assert refused_in_use(graph_refused(), config("FULL_DECODE_ONLY", eager=True)) == []
    assert refused_in_use(graph_refused(), config("PIECEWISE", pa=[1, 2])) == []  # pa_shape_list needs FULL decode


def test_pa_shape_list_with_full_decode_graphs_is_refused_where_graphs_keep_the_sinks():
    lines = refused_in_use(caps("0.20.2rc1"), config("FULL_DECODE_ONLY", pa=[1, 2]))
    assert names(lines) == ["paged_attention_shapes"] and "pa_shape_list [1, 2]" in lines[0]


def test_a_quantized_checkpoint_is_refused_and_bf16_only_on_024():
    assert names(refused_in_use(caps("0.19.1rc1"), config(quantization="mxfp4"))) == ["quantized_moe"]
    assert names(refused_in_use(caps("0.24.0rc1"), config())) == ["checkpoint_bf16"]
    assert refused_in_use(caps("0.23.0"), config()) == []


@pytest.mark.parametrize("release", ["0.11.0", "0.14.0rc1", "0.18.0", "0.19.1rc1", "0.30.0rc2"])
def test_context_parallelism_is_refused_on_every_release(release):
    """AscendAttentionCPImpl has no sinks in any release (0.11 has no context-parallel attention): refused wherever
    pcp or dcp > 1, named with the sizes in use; not at size 1."""
    lines = refused_in_use(caps(release), config(dcp=2))
    assert names(lines) == ["context_parallel"] and lines[0].endswith("(in use: decode_context_parallel_size 2)")
    lines = refused_in_use(caps(release), config(pcp=2, dcp=4))
    assert lines[0].endswith("(in use: prefill_context_parallel_size 2, decode_context_parallel_size 4)")
    assert refused_in_use(caps(release), config()) == []


def test_a_vllm_without_the_context_parallel_fields_counts_them_as_1():
    cfg = config()
    cfg.parallel_config = SimpleNamespace()  # e.g. vLLM 0.11's ParallelConfig has no prefill_context_parallel_size
    assert refused_in_use(caps("0.11.0"), cfg) == []
    cfg.parallel_config = SimpleNamespace(prefill_context_parallel_size=None, decode_context_parallel_size=None)
    assert refused_in_use(caps("0.19.1rc1"), cfg) == []
    cfg.parallel_config = None
    assert refused_in_use(caps("0.19.1rc1"), cfg) == []
    cfg.parallel_config = SimpleNamespace(decode_context_parallel_size=2)  # only the field this vLLM has
    assert names(refused_in_use(caps("0.11.0"), cfg)) == ["context_parallel"]


@pytest.mark.parametrize("value,in_use", [("1", True), ("0", False), ("", False), ("true", True)])
def test_model_runner_v2_is_refused_where_the_release_has_it(monkeypatch, value, in_use):
    """``VLLM_USE_V2_MODEL_RUNNER`` as vLLM parses it (``bool(int(value))``; a value it cannot parse is named, not
    guessed): refused from 0.13.0rc1 (vllm_ascend/worker/v2) on, named with the setting; 0.11 / 0.12 have no v2
    runner, so the variable selects nothing there."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    for release in ("0.13.0", "0.19.1rc1", "0.30.0rc2"):
        lines = refused_in_use(caps(release), config())
        assert names(lines) == (["model_runner_v2"] if in_use else []), (release, lines)
        if in_use:
            assert f"(in use: VLLM_USE_V2_MODEL_RUNNER={value})" in lines[0] and "VLLM_USE_V2_MODEL_RUNNER" in \
                lines[0].split("(in use")[0]
    assert refused_in_use(caps("0.11.0"), config()) == refused_in_use(caps("0.12.0rc1"), config()) == []


def test_model_runner_v2_selected_by_vllm_config_is_refused_too(monkeypatch):
    """vLLM >= 0.23 may select v2 without the variable (``VllmConfig.use_v2_model_runner``), which vllm-ascend's worker
    reads from 0.23.0rc1: refused as well; a property that raises counts as not set."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = config()
    cfg.use_v2_model_runner = True
    lines = refused_in_use(caps("0.26.0rc1"), cfg)
    assert names(lines) == ["model_runner_v2"] and "VllmConfig.use_v2_model_runner" in lines[0]

    class Raising(SimpleNamespace):
        @property
        def use_v2_model_runner(self):
            raise AttributeError("model_config not set")

    raising = Raising(**vars(config()))
    assert refused_in_use(caps("0.26.0rc1"), raising) == []
