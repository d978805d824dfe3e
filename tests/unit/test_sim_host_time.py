"""The simulator's host-time benchmark switch (npu_sim.host_time.host_time_only): stubs in, everything restored."""

import pytest
import torch

from gptoss_patch_testkit import npu_sim
from gptoss_patch_testkit.npu_sim import device
from gptoss_patch_testkit.npu_sim.host_time import STUBS, host_time_only


@pytest.fixture(scope="module")
def tnpu():
    return npu_sim.install()


def test_stubs_return_preallocated_results_of_the_documented_shape(tnpu):
    q = torch.randn(5, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 128, 64, dtype=torch.bfloat16)  # (num_blocks, block_size, KV_N*D), KV_N = 1
    kw = dict(num_query_heads=8, num_key_value_heads=1, input_layout="TND", block_table=torch.zeros(5, 1,
              dtype=torch.int32), block_size=128, actual_seq_qlen=[1, 2, 3, 4, 5], actual_seq_kvlen=[9] * 5)
    k_before = cache.clone()
    with host_time_only():
        out, lse = tnpu.npu_fused_infer_attention_score_v2(q, cache, cache, **kw)
        out2, _ = tnpu.npu_fused_infer_attention_score_v2(q, cache, cache, **kw)
        assert out.shape == (5, 8, 64) and out.dtype == torch.bfloat16 and out2 is out
        assert lse.shape == (1,) and lse.dtype == torch.float32
        _, lse = tnpu.npu_fused_infer_attention_score_v2(q, cache, cache, return_softmax_lse=True, **kw)
        assert lse.shape == (5, 8, 1)
        bsh, _ = tnpu.npu_fused_infer_attention_score(q.view(5, 1, 512), cache, cache, num_heads=8,
                                                      num_key_value_heads=1, input_layout="BSH",
                                                      block_table=kw["block_table"], block_size=128)
        assert bsh.shape == (5, 1, 512)
        assert tnpu._npu_reshape_and_cache(torch.ones(5, 1, 64), torch.ones(5, 1, 64), cache.view(4, 128, 1, 64),
                                           cache.view(4, 128, 1, 64), torch.arange(5, dtype=torch.int32)) is None
        with pytest.raises(RuntimeError):  # the device mapping is suspended: "npu" is not a CPU alias in here
            torch.empty(2, device="npu")
    assert torch.equal(cache, k_before)


def test_everything_is_restored_after_the_switch(tnpu):
    before = {name: getattr(tnpu, name) for name in STUBS}
    with pytest.raises(ValueError):
        with host_time_only():
            raise ValueError("boom")
    assert {name: getattr(tnpu, name) for name in STUBS} == before
    assert torch.empty(2, device="npu").device.type == "cpu"  # device mapping back
    assert device._mode is not None
