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
