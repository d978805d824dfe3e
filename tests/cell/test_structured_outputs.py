"""Structured outputs in a mixed batch (issue 29): on the 0.13.x rows vllm-ascend's runner calls vLLM's real
``apply_grammar_bitmask``, which hands xgrammar the constrained rows as a tensor; the xgrammar 0.1.27 vLLM 0.13 pins
takes a list (vllm-ascend #6820). Shown here on the installed code, in process: upstream's ``TypeError`` where no
GPT-OSS model was built (other models keep upstream's behaviour), the exact mask with gptoss-patch's
``structured_outputs.bitmask_indices`` for a GPT-OSS process. The served request is in tests/cell/api_cases.py."""

import numpy as np
import pytest
import torch
from conftest import ROW

from gptoss_patch import _state, matrix, pairing

STRUCTURED = pairing.structured_outputs()
PATCHED = ROW.caps["structured_outputs"].state == matrix.PATCHED
#: The installed pairing crashes without the patch: vLLM passes a tensor of indices to an xgrammar older than 0.1.30.
CRASHES = STRUCTURED["indices"] == "tensor" and STRUCTURED["problem"] is not None

VOCAB = 64  # two int32 words of bitmask per row
ALLOWED = (3, 7, 40)


def _mixed_batch():
    """vLLM's inputs for a batch of three requests where only ``b`` (batch row 1) is constrained to :data:`ALLOWED`:
    the scheduler's compact bitmask (one row per constrained request, int32 words, bit ``t`` = token ``t`` allowed)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import GrammarOutput

    words = np.zeros((1, VOCAB // 32), dtype=np.int32)
    for t in ALLOWED:
        words[0, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))
    grammar = GrammarOutput(structured_output_request_ids=["b"], grammar_bitmask=words)
    scheduler = SimpleNamespace(scheduled_spec_decode_tokens={})  # the one field apply_grammar_bitmask reads
    batch = SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2})
    logits = torch.arange(3 * VOCAB, dtype=torch.float32).reshape(3, VOCAB) / 7.0
    return scheduler, grammar, batch, logits


def _expected(logits: torch.Tensor) -> torch.Tensor:
    """The mask applied by hand: row 1 keeps :data:`ALLOWED` and is ``-inf`` elsewhere; rows 0 and 2 unchanged."""
    out = logits.clone()
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[list(ALLOWED)] = True
    out[1, ~keep] = float("-inf")
    return out


def test_the_patch_is_registered_exactly_where_the_installed_pairing_crashes():
    import vllm_ascend  # noqa: F401 - activation (the .pth hook)
    # the target module, which xgrammar.apply_token_bitmask_inplace imports at its first CPU call: the hook fires
    import xgrammar.kernels.apply_token_bitmask_inplace_cpu  # noqa: F401

    st = _state.status(drift=False)
    registered = st.details.get("structured_outputs", {})
    if PATCHED and CRASHES:
        assert registered == {"structured_outputs.bitmask_indices": registered["structured_outputs.bitmask_indices"]}
        assert registered["structured_outputs.bitmask_indices"].startswith("applied"), registered
    else:
        assert registered == {}, (ROW.vllm_ascend, STRUCTURED)


if PATCHED and CRASHES:  # only where this row's runner hands xgrammar what its kernel does not take
    def test_vllm_apply_grammar_bitmask_crashes_unpatched_and_masks_exactly_for_gpt_oss(monkeypatch):
        import vllm_ascend  # noqa: F401
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        import vllm_ascend.worker.model_runner_v1 as runner

        assert runner.apply_grammar_bitmask is apply_grammar_bitmask  # the function the NPU runner really calls

        # no GPT-OSS model built in this process: upstream's behaviour, the reported crash
        monkeypatch.setattr(_state, "gpt_oss_built", False)
        scheduler, grammar, batch, logits = _mixed_batch()
        with pytest.raises(TypeError, match=r"apply_token_bitmask_inplace_cpu\(\): incompatible function arguments"):
            apply_grammar_bitmask(scheduler, grammar, batch, logits)

        # a GPT-OSS process: the constrained row is masked, the plain rows are untouched
        monkeypatch.setattr(_state, "gpt_oss_built", True)
        scheduler, grammar, batch, logits = _mixed_batch()
        expected = _expected(logits)
        apply_grammar_bitmask(scheduler, grammar, batch, logits)
        assert torch.equal(logits, expected)


if PATCHED and CRASHES:  # only where this row's runner hands xgrammar what its kernel does not take
    def test_a_batch_of_only_constrained_rows_passes_no_indices_and_never_needed_the_patch(monkeypatch):
        """Why a constrained request alone was fine on 0.13.0: with every row constrained, vLLM passes
        ``indices=None``."""
        import vllm_ascend  # noqa: F401
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        monkeypatch.setattr(_state, "gpt_oss_built", False)
        scheduler, grammar, batch, logits = _mixed_batch()
        batch.req_id_to_index = {"b": 0}
        logits = logits[1:2].clone()
        expected = _expected(torch.cat([logits, logits, logits]))[1:2]
        apply_grammar_bitmask(scheduler, grammar, batch, logits)
        assert torch.equal(logits, expected)
