"""On a natively supporting release the guard still refuses, at start-up, what the release gets wrong for GPT-OSS and
nothing patches: decode sizes listed in ``additional_config.pa_shape_list`` (every release) and context parallelism
(every release). The same model under PIECEWISE builds, and so does it under FULL_DECODE_ONLY graphs, whose capture
drops the sinks upstream up to 0.19.1rc1 (PR #9165 in 0.20.2rc1): since issue 30 our capture replaces it there
(layouts H, G: our forward; I: ``attention_graph.capture_sinks``) - until then this file showed it refused. The
0.15-0.16 / 0.17+ difference (``forward_context.capturing`` vs ``_EXTRA_CTX``) that once argued for refusing instead
is no difference for the v1 runner: ``_EXTRA_CTX`` proxies the forward context's ``capturing`` flag.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROW

from gptoss_patch import matrix

if ROW.layout == "G":  # the native rows whose patches include a function target (moe.activation_name)
    from guard_cases import test_a_patched_function_rebound_to_upstreams_is_named  # noqa: F401

#: Both tests read the one BUILD run of the module fixture: on one xdist worker, so it runs once.
pytestmark = pytest.mark.xdist_group("native_guard")

BUILD = """
import json, sys
from gptoss_patch.selftest import native as n
cfg, ckpt = n.vllm_context()
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
import vllm_ascend.attention.utils as attention_utils


def forget_cp():
    # enable_cp / enable_dcp are lru_cached once per process (one configuration per serving process)
    for name in ("enable_cp", "enable_dcp"):
        getattr(getattr(attention_utils, name, None), "cache_clear", lambda: None)()


import os
out = {}


def build(label, extra):
    try:
        conf = EngineArgs(model=ckpt, dtype="float32", max_model_len=1024, skip_tokenizer_init=True,
                          block_size=n.BLOCK_SIZE, **extra).create_engine_config()
    except Exception as exc:  # vLLM's own validation of the configuration
        out[label] = {"mode": None, "result": "config " + type(exc).__name__ + ": " + str(exc)}
        return
    mode = conf.compilation_config.cudagraph_mode
    with set_current_vllm_config(conf):
        try:
            GptOssForCausalLM(vllm_config=conf)
            out[label] = {"mode": mode.name, "result": "built"}
        except Exception as exc:
            out[label] = {"mode": mode.name, "result": type(exc).__name__ + ": " + str(exc)}
        # what the release's attention backend would hand GPT-OSS's layers under this configuration
        import inspect
        forget_cp()
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackend
        impl = AscendAttentionBackend.get_impl_cls()
        out[label]["impl"] = impl.__qualname__
        out[label]["impl_mentions_sinks"] = "sink" in inspect.getsource(inspect.getmodule(impl))
        out[label]["impl_overrides_forward_impl"] = "forward_impl" in impl.__dict__


for label, extra in json.loads(sys.argv[1]).items():
    forget_cp()
    env = extra.pop("env", {})  # read while the model is built (the guard: VLLM_USE_V2_MODEL_RUNNER)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        build(label, extra)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
print("GUARD-RESULT " + json.dumps(out))
"""

CONFIGS = {
    "full_decode_only": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
    "piecewise": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "pa_shape_list": {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
                      "additional_config": {"pa_shape_list": [1, 2]}},
    # decode context parallelism across the two TP ranks (vLLM: tp % dcp == 0): refused before the build, so the
    # TP-1 world of this process never has to hold a TP-2 model
    "decode_context_parallel": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "tensor_parallel_size": 2,
                                "decode_context_parallel_size": 2},
    # vllm-ascend's model runner v2 (every native release has one): refused before the build, named
    "model_runner_v2": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}, "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}},
}


@pytest.fixture(scope="module")
def built():
    """``BUILD`` over every configuration of ``CONFIGS``, in one fresh interpreter, for the tests of this module."""
    proc = subprocess.run([sys.executable, "-c", BUILD, json.dumps(CONFIGS)], capture_output=True, text=True,
                          timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GUARD-RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("GUARD-RESULT "):])


def test_full_decode_graphs_build_and_pa_shape_list_is_refused_at_start_up(cell, built):
    row = next(r for r in matrix.ROWS if r.vllm_ascend == cell)
    out = built
    print(out)
    assert (out["piecewise"]["mode"], out["piecewise"]["result"]) == ("PIECEWISE", "built")
    full = out["full_decode_only"]
    assert full["mode"] == "FULL_DECODE_ONLY" and row.caps["attention_graph"].state != matrix.REFUSED
    assert full["result"] == "built"  # served with transformers' tokens: test_native_serve.py
    shapes = out["pa_shape_list"]
    assert shapes["result"].startswith("GptOssNotPatchedError") and "refused: paged_attention_shapes" in shapes["result"]
    assert "(in use: pa_shape_list [1, 2] with cudagraph_mode FULL_DECODE_ONLY)" in shapes["result"]


def test_context_parallelism_is_refused_at_start_up(built):
    """``--decode-context-parallel-size 2``: the layers would run vllm-ascend's context-parallel attention impl, which
    has no sinks in any release (docs/upstream.md §4.13); the guard refuses before the build, naming the setting."""
    out = built["decode_context_parallel"]
    print(out)
    assert out["result"].startswith("GptOssNotPatchedError: refusing to build a GPT-OSS model"), out
    assert "refused: context_parallel" in out["result"]
    assert "(in use: decode_context_parallel_size 2)" in out["result"]
    # what would run without the refusal: the release's context-parallel impl, its own forward_impl, no sinks
    assert out["impl"] in ("AscendAttentionCPImpl", "AscendAttentionDCPImpl")
    assert out["impl_overrides_forward_impl"] and not out["impl_mentions_sinks"]
    piecewise = built["piecewise"]
    assert piecewise["impl"] == "AscendAttentionBackendImpl" and piecewise["impl_mentions_sinks"]


def test_model_runner_v2_is_refused_at_start_up_naming_the_variable(built):
    """``VLLM_USE_V2_MODEL_RUNNER=1`` (docs/upstream.md §4.14): the same PIECEWISE build that succeeds with the v1 runner
    (test above) stops before the model is built, naming the capability and the variable to unset."""
    result = built["model_runner_v2"]["result"]
    assert result.startswith("GptOssNotPatchedError: refusing to build a GPT-OSS model"), result
    assert "refused: model_runner_v2" in result and "(in use: VLLM_USE_V2_MODEL_RUNNER=1)" in result, result
    assert built["piecewise"]["result"] == "built"
