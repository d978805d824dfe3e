"""On a natively supporting release the guard still refuses, at start-up, what the release gets wrong for GPT-OSS:
FULL_DECODE_ONLY graphs where the graph path drops the sinks (0.15.0rc1 ... 0.19.1rc1; PR #9165 in 0.20.2rc1), and
decode sizes listed in ``additional_config.pa_shape_list`` (every release). The same model under PIECEWISE builds.

Decision (issue "No vllm-ascend release serves GPT-OSS garbage"): refuse instead of patching upstream's native graph
path: the fix differs per release (0.15-0.16 read ``forward_context.capturing``, 0.17+ ``_EXTRA_CTX``), PIECEWISE is
the mode the seed deployment and vllm-ascend's GPT-OSS tutorial use, and upgrading fixes it upstream.
"""

import json
import subprocess
import sys

from gptoss_patch import matrix

BUILD = """
import json, sys
from gptoss_patch.testing import native_015 as n
cfg, ckpt = n.vllm_context()
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
out = {}
for label, extra in json.loads(sys.argv[1]).items():
    conf = EngineArgs(model=ckpt, dtype="float32", max_model_len=1024, skip_tokenizer_init=True,
                      block_size=n.BLOCK_SIZE, **extra).create_engine_config()
    mode = conf.compilation_config.cudagraph_mode
    with set_current_vllm_config(conf):
        try:
            GptOssForCausalLM(vllm_config=conf)
            out[label] = {"mode": mode.name, "result": "built"}
        except Exception as exc:
            out[label] = {"mode": mode.name, "result": type(exc).__name__ + ": " + str(exc)}
print("GUARD-RESULT " + json.dumps(out))
"""

CONFIGS = {
    "full_decode_only": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    "piecewise": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "pa_shape_list": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
                      "additional_config": {"pa_shape_list": [1, 2]}},
}


def _run():
    proc = subprocess.run([sys.executable, "-c", BUILD, json.dumps(CONFIGS)], capture_output=True, text=True,
                          timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GUARD-RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("GUARD-RESULT "):])


def test_full_decode_graphs_are_refused_at_start_up_where_they_drop_the_sinks(cell):
    row = next(r for r in matrix.ROWS if r.vllm_ascend == cell)
    out = _run()
    print(out)
    assert out["piecewise"] == {"mode": "PIECEWISE", "result": "built"}
    full = out["full_decode_only"]
    assert full["mode"] == "FULL_DECODE_ONLY"
    if row.caps["attention_graph"].state == matrix.REFUSED:
        assert full["result"].startswith("GptOssNotPatchedError: refusing to build a GPT-OSS model")
        assert "refused: attention_graph" in full["result"] and "PIECEWISE" in full["result"]
        assert "(in use: cudagraph_mode FULL_DECODE_ONLY)" in full["result"]
    else:
        assert full["result"] == "built"
    shapes = out["pa_shape_list"]
    assert shapes["result"].startswith("GptOssNotPatchedError") and "refused: paged_attention_shapes" in shapes["result"]
    assert "(in use: pa_shape_list [1, 2] with cudagraph_mode FULL_DECODE_ONLY)" in shapes["result"]
