"""``attention.band_128_keys`` (layout I, issue 30) on a stand-in impl class: what it changes, and only where.

The served proof is tests/cell/native_015 (0.19.1rc1: upstream's forward of an impl built this way equals transformers
with 128 keys; unpatched, with 129). Here the wrapper's own rules: only a GPT-OSS build (the guard's
``_state.building_gpt_oss``), only a layer with sinks and a window, and a window the fused band cannot express named."""

import pytest
import wrapt

from gptoss_patch import _state
from gptoss_patch.patches import attention


class _Impl:
    """What the wrapper reads of ``AscendAttentionBackendImpl.__init__``'s result (0.19.1rc1: it stores both)."""

    def __init__(self, sliding_window, sinks=None):
        self.sliding_window = sliding_window
        self.sinks = sinks


Impl = type("Impl", (), {"__init__": wrapt.FunctionWrapper(_Impl.__init__, attention._band_128_keys)})


def test_a_gpt_oss_sliding_layer_gets_pre_tokens_for_128_keys():
    with _state.building_gpt_oss():
        impl = Impl(128, sinks=object())
    assert (impl.sliding_window, impl.gptoss_window) == (127, 128)
    assert _state.gpt_oss_building is False  # restored


@pytest.mark.parametrize("window,sinks,building", [(128, object(), False), (128, None, True), (None, object(), True)],
                         ids=["other model", "no sinks", "full attention"])
def test_other_layers_keep_upstreams_window(window, sinks, building):
    if building:
        with _state.building_gpt_oss():
            impl = Impl(window, sinks=sinks)
    else:
        impl = Impl(window, sinks=sinks)
    assert impl.sliding_window == window and not hasattr(impl, "gptoss_window")


def test_a_window_the_band_cannot_express_is_named():
    with _state.building_gpt_oss(), pytest.raises(ValueError, match="sliding_window must be >= 2.*got 1.*128"):
        Impl(1, sinks=object())
    assert _state.gpt_oss_building is False


class _Layer:
    def __init__(self, impl):
        self.impl = impl


class _Model:
    """``named_modules()`` and ``config`` as the guard reads them from a built ``GptOssForCausalLM``."""

    def __init__(self, *impls, window=128):
        self.config = type("Cfg", (), {"sliding_window": window})()
        self._layers = [(f"model.layers.{i}.attn.attn", _Layer(impl)) for i, impl in enumerate(impls)]

    def named_modules(self):
        return [("", self), *self._layers]


def test_the_guard_names_a_sliding_layer_left_off_the_band():
    """The build check (guard.check_runs on layouts I, J): a sliding impl built inside the GPT-OSS build passes, one
    built outside it (upstream's 129 keys) is named with the keys it would attend; full layers and sink-less ones are
    not the band's."""
    with _state.building_gpt_oss():
        banded = Impl(128, sinks=object())
        full = Impl(None, sinks=object())
    stray = Impl(128, sinks=object())
    assert attention.band_problems(_Model(banded, full, Impl(128))) == []
    problems = attention.band_problems(_Model(banded, full, stray))
    assert len(problems) == 1 and "model.layers.2.attn.attn" in problems[0] and "attend 129 keys" in problems[0]
    with _state.building_gpt_oss():
        other_window = Impl(64, sinks=object())
    assert "attend 64 keys" in attention.band_problems(_Model(other_window))[0]  # config says 128
