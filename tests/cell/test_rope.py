"""GPT-OSS's YaRN rotary embedding (``rope_scaling.truncate = false``) on vllm-ascend, against transformers.

Every apply cell runs this file. The rope is the one vLLM's ``gpt_oss.py`` builds (``get_rope(..., yarn, factor 32,
beta_fast 32, beta_slow 1, original_max_position_embeddings 4096[, truncate])`` -> vllm-ascend's OOT
``AscendYaRNRotaryEmbedding``), taken from a tiny GPT-OSS model loaded by vLLM's own loader, or built directly with the
same arguments. The oracle is transformers 4.57's ``GptOssRotaryEmbedding`` (``_compute_yarn_parameters`` with
``truncate=False``: the YaRN correction range is not rounded) and its ``apply_rotary_pos_emb``.

What differs per release (``docs/upstream.md`` §7.6, §8.1, §4.9): vLLM 0.11 never passes ``truncate`` and always
rounds; vLLM >= 0.12 passes ``truncate=False`` from the model's ``rope_parameters``, which vllm-ascend <= 0.14.0rc1's
``AscendYaRNRotaryEmbedding.__init__`` rejects (``TypeError`` at model construction) and whose parent call drops.
vllm-ascend >= 0.13.0rc1 also records the first rope's cache in the module global ``_cos_sin_cache``.

Tolerances: the float32 ``cos_sin_cache`` equals transformers' cos/sin within ``1e-6`` absolute (both compute
``cos(position * inv_freq) * mscale`` in float32; measured: 0.0, bit-identical, over all 131072 positions in every
cell); the rounded (unpatched) cache differs by more than ``1e-2`` (measured: 2.69 max absolute in every cell - the
rounded ramp changes some frequencies, and the phase error grows with the position). Rotated q/k in float32: relative
error ``<= 1e-5``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gptoss_patch.selftest import worker as vllm_setup
from gptoss_patch.selftest.tiny import write_checkpoint

HEAD_DIM = 64
CACHE_TOL = 1e-6
ROUNDED_MIN_DIFF = 1e-2


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny GPT-OSS checkpoint (head_dim 64, GPT-OSS's YaRN rope_scaling with truncate false, 2 layers)."""
    path = tmp_path_factory.mktemp("rope_ckpt")
    write_checkpoint(path, preset="tiny", seed=5, tokenizer=False, num_hidden_layers=2, num_local_experts=4,
                     vocab_size=512, pad_token_id=511, eos_token_id=510)
    return path


@pytest.fixture(scope="session")
def cfg(ckpt):
    return vllm_setup.engine_config(ckpt, dtype="float32")


@pytest.fixture(scope="session")
def hf_config(ckpt):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt)
    assert config.rope_scaling["truncate"] is False and config.head_dim == HEAD_DIM
    return config


@pytest.fixture(scope="session")
def hf_cos_sin(hf_config):
    """transformers' cos / sin ``[max_position_embeddings, head_dim / 2]`` (float32) for every position."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    rope = GptOssRotaryEmbedding(hf_config)
    positions = torch.arange(hf_config.max_position_embeddings)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


@pytest.fixture(scope="session")
def model(cfg):
    with vllm_setup.ascend_context(vllm_config=cfg):
        return vllm_setup.load_model(cfg)


def yarn_class():
    from vllm_ascend.ops.rotary_embedding import AscendYaRNRotaryEmbedding

    return AscendYaRNRotaryEmbedding


def build_direct(cfg, hf_config, **extra):
    """``AscendYaRNRotaryEmbedding`` with the arguments vLLM's ``get_rope`` gives it for GPT-OSS (float32 cache)."""
    s = hf_config.rope_scaling
    with vllm_setup.ascend_context(vllm_config=cfg):
        return yarn_class()(HEAD_DIM, HEAD_DIM, s["original_max_position_embeddings"], hf_config.rope_theta, True,
                            s["factor"], torch.float32, beta_fast=s["beta_fast"], beta_slow=s["beta_slow"], **extra)


def cache_diff(cache, hf_cos_sin):
    cos, sin = hf_cos_sin
    half = cache.shape[-1] // 2
    assert cache.shape[0] == cos.shape[0], (cache.shape, cos.shape)
    return max((cache[:, :half].float() - cos).abs().max().item(), (cache[:, half:].float() - sin).abs().max().item())


@contextlib.contextmanager
def unpatched_yarn_init():
    """``AscendYaRNRotaryEmbedding.__init__`` without the patch for the duration (the original put back after)."""
    cls = yarn_class()
    wrapper = cls.__dict__["__init__"]
    cls.__init__ = wrapper.__wrapped__
    try:
        yield
    finally:
        cls.__init__ = wrapper


# ----------------------------------------------------------------------------------------------------------- plumbing


def test_rope_patch_applied(layout):
    import gptoss_patch
    from gptoss_patch import matrix

    cls = yarn_class()  # imports vllm_ascend: activation and the patch happen on that import
    states = {p.name: (p.state, p.target) for p in gptoss_patch.status().patches}
    assert states["yarn.truncate"] == ("applied", matrix.LAYOUTS[layout]["yarn_rope_init"])
    assert getattr(cls.__dict__["__init__"], "_self_gptoss_patch_name", None) == "yarn.truncate"


# ------------------------------------------------------------------------------------------------------ vs transformers


def test_model_ropes_match_transformers(model, hf_cos_sin):
    """Every attention layer's rope, as vLLM's loader builds the model: vllm-ascend's YaRN class with
    ``truncate=False`` and the unrounded cos/sin cache of transformers, at every one of the 131072 positions."""
    for layer in model.model.layers:
        rope = layer.attn.rotary_emb
        assert type(rope) is yarn_class()
        assert rope.truncate is False
        assert rope.cos_sin_cache.dtype == torch.float32 and tuple(rope.cos_sin_cache.shape) == (131072, HEAD_DIM)
        assert cache_diff(rope.cos_sin_cache, hf_cos_sin) <= CACHE_TOL


def test_rotation_matches_transformers(model, cfg, hf_config):
    """The rope's forward (vllm-ascend ``forward_oot`` -> ``_npu_rotary_embedding`` with the cache) on random q/k at
    positions up to 131071 equals transformers' ``apply_rotary_pos_emb`` with its cos/sin (float32)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding, apply_rotary_pos_emb

    rope = model.model.layers[0].attn.rotary_emb
    g = torch.Generator().manual_seed(3)
    positions = torch.cat([torch.arange(16), torch.randint(16, 131072, (48,), generator=g), torch.tensor([131071])])
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    q = torch.randn(positions.numel(), heads * HEAD_DIM, generator=g)
    k = torch.randn(positions.numel(), kv_heads * HEAD_DIM, generator=g)
    cos, sin = GptOssRotaryEmbedding(hf_config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, -1, heads, HEAD_DIM).transpose(1, 2),
                                        k.view(1, -1, kv_heads, HEAD_DIM).transpose(1, 2), cos, sin)
    from gptoss_patch.selftest.moe import select_moe_comm_type

    n = positions.numel()
    with vllm_setup.ascend_context(vllm_config=cfg), vllm_setup.forward_context(
            cfg, n, moe_comm_type=select_moe_comm_type(cfg, n)):
        q_out, k_out = rope(positions, q.clone(), k.clone())
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        ref = ref.transpose(1, 2).reshape(out.shape)
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_direct_construction_with_truncate_keyword(cfg, hf_config, hf_cos_sin):
    """vLLM >= 0.12's ``get_rope`` passes ``truncate=``: the patched class accepts it (False: recomputed cache; True:
    upstream's rounded cache kept)."""
    untruncated = build_direct(cfg, hf_config, truncate=False)
    assert untruncated.truncate is False and cache_diff(untruncated.cos_sin_cache, hf_cos_sin) <= CACHE_TOL
    rounded = build_direct(cfg, hf_config, truncate=True)
    assert rounded.truncate is True and cache_diff(rounded.cos_sin_cache, hf_cos_sin) > ROUNDED_MIN_DIFF


def test_recorded_global_cache_follows_the_recomputed_cache(cfg, hf_config, hf_cos_sin):
    """vllm-ascend >= 0.13.0rc1 records the first rope's cache in ``vllm_ascend.ops.rotary_embedding._cos_sin_cache``
    (read by ``update_cos_sin`` for head size 128): after the patch it is the recomputed (transformers) cache, not the
    rounded one upstream computed first. Releases without that global (0.11.x, 0.12.0rc1) have nothing to follow."""
    import vllm_ascend.ops.rotary_embedding as rot

    if not hasattr(rot, "_record_cos_sin_cache"):
        assert not hasattr(rot, "_cos_sin_cache")
        return
    saved = rot._cos_sin_cache
    rot._cos_sin_cache = None  # as in a fresh worker, where GPT-OSS's rope is the first one built
    try:
        rope = build_direct(cfg, hf_config, truncate=False)
        assert rot._cos_sin_cache is rope.cos_sin_cache
        assert cache_diff(rot._cos_sin_cache, hf_cos_sin) <= CACHE_TOL
    finally:
        rot._cos_sin_cache = saved


def test_vllm_native_yarn_with_truncate_false_is_the_same_cache(layout, cfg, hf_config):
    """vLLM >= 0.12's own ``YaRNScalingRotaryEmbedding(..., truncate=False)`` computes exactly our cache (bit for bit):
    the patch restores vLLM's intended behaviour. vLLM 0.11 (layout B) has no ``truncate`` parameter."""
    import inspect

    from vllm.model_executor.layers.rotary_embedding import YaRNScalingRotaryEmbedding

    params = inspect.signature(YaRNScalingRotaryEmbedding.__init__).parameters
    assert ("truncate" in params) is (layout != "B")
    if layout == "B":
        return
    s = hf_config.rope_scaling
    ours = build_direct(cfg, hf_config, truncate=False).cos_sin_cache
    native = YaRNScalingRotaryEmbedding._compute_cos_sin_cache(
        _native_holder(YaRNScalingRotaryEmbedding, s, hf_config.rope_theta))
    assert torch.equal(ours, native.to(ours.dtype))


def _native_holder(cls, s, base):
    """An object with the attributes vLLM's ``YaRNScalingRotaryEmbedding._compute_cos_sin_cache`` reads, set the way
    its ``__init__`` sets them for GPT-OSS with ``truncate=False`` (no CustomOp dispatch, so no OOT class swap)."""
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    holder = object.__new__(cls)
    vars(holder).update(head_size=HEAD_DIM, rotary_dim=HEAD_DIM,
                        max_position_embeddings=s["original_max_position_embeddings"], base=base, is_neox_style=True,
                        scaling_factor=s["factor"], extrapolation_factor=1, attn_factor=1, beta_fast=s["beta_fast"],
                        beta_slow=s["beta_slow"], truncate=False, mscale=float(yarn_get_mscale(s["factor"])))
    return holder


# ------------------------------------------------------------------------------------------------- unpatched upstream


def test_unpatched_upstream_is_wrong_or_crashes(cfg, hf_config, hf_cos_sin, layout):
    """Without the patch: on vLLM >= 0.12 (layouts C, E, F) the Ascend class rejects the ``truncate`` keyword that
    ``get_rope`` passes for GPT-OSS (model construction fails); without the keyword (vLLM 0.11's call) its cache is the
    rounded one, off from transformers by more than 1e-2."""
    with unpatched_yarn_init():
        if layout != "B":
            with pytest.raises(TypeError, match="truncate"):
                build_direct(cfg, hf_config, truncate=False)
        rope = build_direct(cfg, hf_config)
    assert not hasattr(rope, "truncate") or rope.truncate is True
    assert cache_diff(rope.cos_sin_cache, hf_cos_sin) > ROUNDED_MIN_DIFF
