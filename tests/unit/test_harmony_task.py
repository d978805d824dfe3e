"""The harmony task and the trained tiny GPT-OSS (gptoss_patch.selftest.harmony): the items hold the layout the
capabilities are tested with, the committed weights expand into a checkpoint transformers loads, the model answers
the held-out items through transformers, and the judge tells right from wrong."""

from __future__ import annotations

import json

import pytest

from gptoss_patch.selftest import harmony
from gptoss_patch.tools import tokenizer


@pytest.fixture(scope="module", autouse=True)
def vocab(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in tokenizer.prepare(tmp_path_factory.mktemp("vocab")).env.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def items():
    return harmony.eval_items(30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return harmony.write_checkpoint(tmp_path_factory.mktemp("harmony-ckpt"), tokenizer=False)


def test_assistant_and_user_ids_are_o200k_harmony():
    _, enc = harmony.encoding()
    assert enc.encode("assistant", disallowed_special=()) == [harmony._assistant_id()]


def test_items_hold_the_window_layout(items):
    """Every held-out item has its nearest decoy exactly 128 tokens before the position that writes the mode (inside
    a 129-key band, outside GPT-OSS's 128), the real statement 20..120 tokens before it, and the code more than 128
    tokens before the request."""
    for it in items:
        m = it["meta"]
        assert m["d_near"] == harmony.WINDOW
        if m["mode"] != "none":
            assert 20 <= m["d_real"] <= 120
        user = it["tokens"][:m["p1"]]
        code_tok = harmony.encoding()[1].encode(f" {m['code']}", disallowed_special=())[0]
        assert m["q"] - user.index(code_tok) > harmony.WINDOW
    assert {it["meta"]["kind"] for it in items} == set(harmony.KINDS)
    assert any(it["meta"]["mode"] == "none" for it in items)


def test_items_are_deterministic():
    a, b = harmony.eval_items(6), harmony.eval_items(6)
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    assert [x["tokens"] for x in a] != [x["tokens"] for x in harmony.eval_items(6, seed=1)]


def test_checkpoint_expands_the_compact_rows(checkpoint):
    from safetensors.torch import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["vocab_size"] == 201088 and cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["rope_scaling"]["truncate"] is False and cfg["sliding_window"] == 128
    full, compact = load_file(str(checkpoint / "model.safetensors")), load_file(str(harmony.WEIGHTS))
    used = compact["task.used_ids"].tolist()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert full[name].shape == (201088, 64)
        assert full[name][used].equal(compact[name][:-1])
        unused = sorted(set(range(201088)) - set(used))[::997]
        assert (full[name][unused] == compact[name][-1]).all()
    assert full["model.layers.0.mlp.experts.gate_up_proj_bias"].abs().max() > 0  # the biases are trained values


def test_transformers_answers_the_held_out_items(checkpoint, items):
    """The reference the served model is compared with: transformers' float32 greedy answers are mostly right."""
    from gptoss_patch_testkit import ablations

    acc, verdicts = ablations.accuracy(ablations.load(checkpoint), items)
    assert acc >= 0.8, verdicts


@pytest.mark.parametrize("kind, fields, reason", [
    ("recall", {"final": "Nobody has code 1, mode fast."}, "expected"),
    ("json", {"final": "{'name': 'x'}"}, "is not JSON"),
    ("tool", {"call_name": "lookup_order", "call_arguments": '{"order_id": "12", "mode": "fast"}'}, "is not of type"),
    ("tool", {"call_name": "other", "call_arguments": "{}"}, "no call of lookup_order"),
])
def test_judge_says_why_an_answer_is_wrong(items, kind, fields, reason):
    item = next(it for it in items if it["meta"]["kind"] == kind)
    right, detail = harmony.judge(item, **fields)
    assert not right and reason in detail


def test_judge_accepts_the_reference_answer(items):
    for it in items:
        m = it["meta"]
        if m["kind"] == "tool":
            assert harmony.judge(it, call_name="lookup_order", call_arguments=json.dumps(m["call_args"]),
                                 final_after_tool=m["final"]) == (True, "")
        else:
            assert harmony.judge(it, final=m["final"]) == (True, "")


def test_the_local_task_file_holds_the_held_out_items():
    """tests/data/harmony/test.jsonl - the accuracy runner's local task - is :func:`harmony.local_task_rows`: the
    recall and json items the API tests ask, each answer the final message :func:`harmony.judge` accepts."""
    from pathlib import Path

    from gptoss_patch.tools.eval_accuracy import load_local

    rows = load_local(Path(__file__).resolve().parents[1] / "data" / "harmony" / "test.jsonl")
    assert rows == harmony.local_task_rows() and len(rows) == 8
    items = harmony.eval_items(12, kinds=("recall", "json"))
    assert all(harmony.judge(it, final=row["answer"])[0] for it, row in zip(items, rows))
    assert not any(harmony.judge(it, final=row["answer"])[0] for it, row in zip(items, rows[1:] + rows[:1]))
