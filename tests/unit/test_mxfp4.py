"""MXFP4 dequantization (gptoss_patch.kernels.mxfp4), the tiny MXFP4 writer and the MXFP4 checkpoint checks, against
transformers' own dequantizer (``transformers/integrations/mxfp4.py`` ``convert_moe_packed_tensors``, the code
``Mxfp4Config(dequantize=True)`` runs)."""

import json
import os

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from gptoss_patch import matrix
from gptoss_patch.kernels import mxfp4 as mx
from gptoss_patch import checkpoints
from gptoss_patch.patches import checkpoint_mxfp4 as patch


def _bits(t):
    return t.contiguous().view(torch.int16)


def _pair(E, R, G, seed=0, lo=0, hi=256):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, R, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (E, R, G), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("lo,hi", [(0, 256), (110, 140)])
def test_dequantize_is_bit_exact_against_transformers(lo, hi):
    """Every FP4 code and every E8M0 scale (including 0, 254, 255: subnormal, overflow, inf/nan products)."""
    blocks, scales = _pair(3, 48, 4, lo=lo, hi=hi)
    want = convert_moe_packed_tensors(blocks.clone(), scales.clone())  # [E, C, R]
    got = mx.dequantize(blocks, scales).transpose(1, 2)
    assert torch.equal(_bits(got), _bits(want))


def test_lazy_tensor_under_vllms_rank_slicing_equals_transformers_sliced():
    """gpt-oss-120b's own expert geometry (H = I = 2880, 90 blocks) on 2 experts: vLLM's ``_load_weights_other``
    slicing for every TP-8 rank (per-rank intermediate 360 - down_proj's rank boundaries cut MXFP4 blocks) and for EP,
    then ``.permute(0, 2, 1).contiguous()`` and ``param.copy_``: bit for bit transformers' full dequantization, sliced
    the same way."""
    H = I = 2880
    shapes_gu = mx.expected_shapes("gate_up_proj", 2, H, I)
    shapes_dn = mx.expected_shapes("down_proj", 2, H, I)
    gu_b, gu_s = _pair(*shapes_gu["scales"], seed=1, lo=115, hi=135)
    dn_b, dn_s = _pair(*shapes_dn["scales"], seed=2, lo=115, hi=135)
    gate_up = convert_moe_packed_tensors(gu_b.clone(), gu_s.clone())  # [E, H, 2I]
    down = convert_moe_packed_tensors(dn_b.clone(), dn_s.clone())  # [E, I, H]
    per = I // 8
    for rank in (0, 3, 7):
        s, e = rank * per, (rank + 1) * per
        param = torch.empty(2, 2 * per, H, dtype=torch.bfloat16)
        param.copy_(mx.LazyMxfp4.create(gu_b, gu_s)[:, :, 2 * s:2 * e].permute(0, 2, 1).contiguous())
        assert torch.equal(_bits(param), _bits(gate_up[:, :, 2 * s:2 * e].permute(0, 2, 1)))
        param = torch.empty(2, H, per, dtype=torch.bfloat16)
        param.copy_(mx.LazyMxfp4.create(dn_b, dn_s)[:, s:e, :].permute(0, 2, 1).contiguous())
        assert torch.equal(_bits(param), _bits(down[:, s:e, :].permute(0, 2, 1)))
    param = torch.empty(1, H, 2 * I, dtype=torch.bfloat16)  # EP: whole experts, then permuted
    param.copy_(mx.LazyMxfp4.create(gu_b, gu_s)[1:2, ...].permute(0, 2, 1).contiguous().permute(0, 2, 1))
    assert torch.equal(_bits(param), _bits(gate_up[1:2]))


def test_lazy_tensor_materializes_only_the_sliced_region(monkeypatch):
    blocks, scales = _pair(4, 64, 3)
    seen = []
    real = mx.dequantize_region

    def spy(b, s, experts, rows, cols, dtype=torch.bfloat16):
        seen.append((experts, rows, cols))
        return real(b, s, experts, rows, cols, dtype)

    monkeypatch.setattr(mx, "dequantize_region", spy)
    out = mx.LazyMxfp4.create(blocks, scales)[1:3, 40:70, 8:24].permute(0, 2, 1).contiguous() + 0
    assert seen == [((1, 3), (8, 24), (40, 70))]
    assert out.shape == (2, 16, 30) and type(out) is torch.Tensor


def test_quantize_rounds_to_the_nearest_fp4_value_with_the_smallest_sufficient_scale():
    """Our writer, checked through transformers' dequantizer: every block's largest magnitude fits FP4's +-6 at its
    scale, and each element is the nearest FP4 value (error <= half the local FP4 spacing times the scale)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 16, 128, generator=g) * torch.logspace(-3, 2, 16).view(1, 16, 1)
    w[0, 0, :32] = 0.0  # an all-zero block
    blocks, scales = mx.quantize(w)
    dq = convert_moe_packed_tensors(blocks, scales).transpose(1, 2).float()  # back to block layout
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert (w.abs() / scale <= 6).all()
    grid = torch.tensor(mx.FP4_VALUES[:8])
    x = (w / scale).abs()
    nearest = grid[(x.unsqueeze(-1) - grid).abs().argmin(-1)] * torch.sign(w)
    assert torch.equal(dq, nearest * scale)
    assert torch.equal(dq[0, 0, :32], torch.zeros(32))


def test_tiny_mxfp4_checkpoint_is_the_official_layout_and_transformers_dequantizes_it(tmp_path):
    from safetensors.torch import load_file

    from gptoss_patch.selftest.tiny import MXFP4_QUANTIZATION_CONFIG, write_checkpoint

    bf16 = write_checkpoint(tmp_path / "bf16", preset="tiny-mxfp4", seed=0, tokenizer=False)
    mxd = write_checkpoint(tmp_path / "mx", preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
    config = json.loads((mxd / "config.json").read_text())
    assert config["quantization_config"] == MXFP4_QUANTIZATION_CONFIG
    ref, got = load_file(str(bf16 / "model.safetensors")), load_file(str(mxd / "model.safetensors"))
    E, H, I = 8, 64, 384
    for layer in range(4):
        base = f"model.layers.{layer}.mlp.experts."
        assert got[base + "gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16)
        assert got[base + "gate_up_proj_scales"].shape == (E, 2 * I, H // 32)
        assert got[base + "down_proj_blocks"].shape == (E, H, I // 32, 16)
        assert got[base + "down_proj_scales"].shape == (E, H, I // 32)
        assert base + "gate_up_proj" not in got and torch.equal(got[base + "gate_up_proj_bias"],
                                                                ref[base + "gate_up_proj_bias"])
        for kind in ("gate_up_proj", "down_proj"):
            dq = convert_moe_packed_tensors(got[base + kind + "_blocks"], got[base + kind + "_scales"]).float()
            w = ref[base + kind].float()
            # within MXFP4's rounding of the BF16 weights: relative RMS error of FP4 E2M1 on Gaussian blocks ~ 0.1
            assert dq.shape == w.shape and ((dq - w).norm() / w.norm()) < 0.2
    assert set(ref) - {n for n in ref if n.endswith(("experts.gate_up_proj", "experts.down_proj"))} <= set(got)


class _Cfg:
    model_type = "gpt_oss"
    num_local_experts, hidden_size, intermediate_size = 2, 64, 96
    quantization_config = {"quant_method": "mxfp4"}


def _stream_pairs():
    s = mx.expected_shapes("gate_up_proj", 2, 64, 96)
    return (torch.zeros(s["blocks"], dtype=torch.uint8), torch.zeros(s["scales"], dtype=torch.uint8),
            s["scales"])


def test_stream_turns_pairs_into_lazy_bf16_tensors_and_passes_the_rest():
    blocks, scales, _ = _stream_pairs()
    bias = torch.ones(2, 192)
    out = list(patch.dequantized_stream([("model.layers.0.mlp.experts.w13_weight", blocks),
                                         ("model.layers.0.mlp.experts.w13_bias", bias),
                                         ("model.layers.0.mlp.experts.w13_weight_scale", scales)], _Cfg()))
    assert [n for n, _ in out] == ["model.layers.0.mlp.experts.w13_bias", "model.layers.0.mlp.experts.w13_weight"]
    assert out[0][1] is bias and isinstance(out[1][1], mx.LazyMxfp4) and out[1][1].shape == (2, 64, 192)


def test_stream_blocks_without_scales_names_the_tensor_and_expected_shape():
    blocks, _, want = _stream_pairs()
    with pytest.raises(patch.Mxfp4CheckpointError) as err:
        list(patch.dequantized_stream([("model.layers.0.mlp.experts.w13_weight", blocks)], _Cfg()))
    assert ("model.layers.0.mlp.experts.gate_up_proj_blocks has no model.layers.0.mlp.experts.gate_up_proj_scales "
            f"(expected shape {list(want)} uint8)") in str(err.value)


def test_stream_carries_a_half_pair_to_the_next_call_and_names_it_when_the_stream_ends():
    """vLLM's AutoWeightsLoader calls GptOssModel.load_weights once per run of ``model.*`` names: a pair whose halves
    sit in two shards with ``lm_head.weight`` between them comes in two calls. With a ``pending`` dict the blocks
    wait for their scales across the calls; left unpaired, :func:`incomplete_pairs_error` names the missing tensor."""
    blocks, scales, want = _stream_pairs()
    pending = {}
    first = list(patch.dequantized_stream([("model.layers.0.mlp.experts.w13_weight", blocks),
                                           ("model.layers.0.mlp.experts.w13_bias", torch.ones(2, 192))],
                                          _Cfg(), pending))
    assert [n for n, _ in first] == ["model.layers.0.mlp.experts.w13_bias"] and len(pending) == 1
    second = list(patch.dequantized_stream([("model.layers.0.mlp.experts.w13_weight_scale", scales)], _Cfg(),
                                           pending))
    assert [n for n, _ in second] == ["model.layers.0.mlp.experts.w13_weight"] and pending == {}
    assert isinstance(second[0][1], mx.LazyMxfp4) and second[0][1].shape == (2, 64, 192)
    # a half still waiting when the whole stream ended
    list(patch.dequantized_stream([("model.layers.1.mlp.experts.w13_weight", blocks)], _Cfg(), pending))
    assert str(patch.incomplete_pairs_error(pending, _Cfg())) == (
        "MXFP4 GPT-OSS checkpoint incomplete, nothing was served: model.layers.1.mlp.experts.gate_up_proj_blocks has "
        f"no model.layers.1.mlp.experts.gate_up_proj_scales (expected shape {list(want)} uint8)")


def test_stream_wrong_scale_shape_names_the_tensor_and_expected_shape():
    blocks, scales, want = _stream_pairs()
    with pytest.raises(patch.Mxfp4CheckpointError) as err:
        list(patch.dequantized_stream([("model.layers.0.mlp.experts.w13_weight", blocks),
                                       ("model.layers.0.mlp.experts.w13_weight_scale", scales[:, :100])], _Cfg()))
    assert (f"model.layers.0.mlp.experts.gate_up_proj_scales: shape [2, 100, 2] dtype uint8, expected shape "
            f"{list(want)} uint8") in str(err.value)


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    from gptoss_patch.selftest.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("mx"), preset="tiny-mxfp4", seed=0, tokenizer=False,
                            quantization="mxfp4")


def _rewrite(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_check_files_accepts_the_tiny_mxfp4_checkpoint(mx_ckpt):
    assert checkpoints.check_files(str(mx_ckpt)) == []


def test_check_files_blocks_without_scales(mx_ckpt, tmp_path):
    d = _rewrite(mx_ckpt, tmp_path / "c", lambda t: t.pop("model.layers.2.mlp.experts.down_proj_scales"))
    assert checkpoints.check_files(str(d)) == ["model.layers.2.mlp.experts.down_proj_blocks has no "
                                         "model.layers.2.mlp.experts.down_proj_scales (expected shape [8, 64, 12] "
                                         "uint8)"]


def test_check_files_wrong_scale_shape(mx_ckpt, tmp_path):
    def edit(t):
        name = "model.layers.1.mlp.experts.gate_up_proj_scales"
        t[name] = t[name][:, :, :1].contiguous()

    d = _rewrite(mx_ckpt, tmp_path / "c", edit)
    assert checkpoints.check_files(str(d)) == ["model.layers.1.mlp.experts.gate_up_proj_scales: shape [8, 768, 1] U8, "
                                         "expected shape [8, 768, 2] U8"]


def test_check_files_truncated_shard(mx_ckpt, tmp_path):
    import shutil

    d = tmp_path / "c"
    shutil.copytree(mx_ckpt, d)
    path = d / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    problems = checkpoints.check_files(str(d))
    assert problems and all("truncated shard" in p and "expected shape [" in p for p in problems)
    assert any(p.startswith("model.") for p in problems)


def test_every_row_judges_mxfp4_and_the_cells_patch_it():
    for row in matrix.ROWS:
        if not row.caps:
            continue
        state = row.caps["checkpoint_mxfp4"].state
        if row.version <= matrix.Version("0.19.1rc1"):
            assert state == matrix.PATCHED, row.vllm_ascend
        else:
            assert state == matrix.REFUSED, row.vllm_ascend
