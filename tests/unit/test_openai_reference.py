"""OpenAI's own reference implementation (``gpt-oss`` on PyPI, ``gpt_oss/torch/model.py``, float32) as the second
oracle of the trained harmony model (issue 29; :mod:`gptoss_patch_testkit.openai_reference`): it answers every held-out
item with transformers' tokens, and the two oracles agree on what GPT-OSS's 128-key window is (with 129 keys both lose
the same answers)."""

from __future__ import annotations

import json

import pytest

from gptoss_patch.selftest import harmony
from conftest import harmony_setup
from gptoss_patch_testkit import ablations, openai_reference

ITEMS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    for ckpt, items in harmony_setup(tmp_path_factory, ITEMS):
        yield ckpt, items, ablations.load(ckpt), openai_reference.load(ckpt)


def test_the_reference_is_openais_code():
    import gpt_oss.torch.model as model

    assert openai_reference.available()
    assert model.__file__.endswith("gpt_oss/torch/model.py") and "site-packages" in model.__file__


def test_openais_reference_answers_every_item_with_transformers_tokens(setup):
    ckpt, items, hf, ref = setup
    answers = [ablations.answer_tokens(ref, it) for it in items]
    assert answers == [ablations.answer_tokens(hf, it) for it in items]
    assert ablations.accuracy(ref, items)[0] == ablations.accuracy(hf, items)[0] == 1.0


def test_openais_logits_match_transformers_on_a_whole_conversation(setup):
    import torch

    ckpt, items, hf, ref = setup
    toks = items[0]["tokens"]  # longer than the window: both attention kinds and YaRN past the first positions
    assert len(toks) > harmony.WINDOW
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([toks])).logits[0]
        got = ref.model.unembedding(ref._hidden(toks))
    assert torch.allclose(got, expected, atol=2e-4, rtol=0), (got - expected).abs().max().item()


def test_both_oracles_lose_the_same_answers_with_a_129_key_band(setup):
    """The negative control: OpenAI's attention with ``sliding_window`` 129 (its mask ``tril(-inf, diagonal=-129)``)
    answers exactly as transformers' ``band129`` ablation, and worse than with 128."""
    ckpt, items, hf, _ = setup
    ref = openai_reference.load(ckpt)
    for block in ref.model.block:
        if block.attn.sliding_window:
            block.attn.sliding_window += 1
    band = ablations.load(ckpt, "band129")
    answers = [ablations.answer_tokens(ref, it) for it in items]
    assert answers == [ablations.answer_tokens(band, it) for it in items]
    assert ablations.accuracy(ref, items)[0] < 1.0


def test_a_checkpoint_the_reference_would_compute_otherwise_is_named(tmp_path):
    config = json.loads((harmony.write_checkpoint(tmp_path / "c", tokenizer=False) / "config.json").read_text())
    wrong = [dict(config, layer_types=["full_attention", "sliding_attention"]),
             dict(config, rope_scaling=dict(config["rope_scaling"], truncate=True)),
             dict(config, model_type="llama")]
    messages = ["windows exactly the even layers", "never rounds YaRN", "computes gpt_oss only"]
    for cfg, message in zip(wrong, messages):
        with pytest.raises(ValueError, match=message):
            openai_reference._config(cfg)


def test_write_original_is_what_openais_own_loader_reads(tmp_path):
    """The ``original/`` folder the MXFP4 test checkpoints carry (as the official repositories do;
    ``openai_reference.write_original``) is read by OpenAI's own ``Transformer.from_checkpoint`` (its ``Checkpoint``
    dequantizes the ``.blocks``/``.scales`` pairs): every parameter equals the Hugging Face files' tensor under the
    reference's names, the experts as transformers' ``convert_moe_packed_tensors`` dequantizes them."""
    import torch
    from gpt_oss.torch.model import Transformer
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gptoss_patch.selftest.tiny import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "mx", preset="tiny-mxfp4", seed=0, tokenizer=False, quantization="mxfp4")
    original = openai_reference.write_original(ckpt)
    model = Transformer.from_checkpoint(str(original), device="cpu")
    hf = load_file(str(ckpt / "model.safetensors"))
    for key in [k for k in hf if k.endswith("_blocks")]:
        base = key[: -len("_blocks")]
        hf[base] = convert_moe_packed_tensors(hf.pop(key), hf.pop(base + "_scales"))
    want = openai_reference.reference_tensors(hf, json.loads((ckpt / "config.json").read_text())["num_hidden_layers"])
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, param in got.items():
        assert torch.equal(param.detach(), want[name].to(param.dtype)), name
