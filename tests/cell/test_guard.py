"""The guard checks what runs, not only what was wrapped (patched rows, layouts B-F).

* On an Atlas 310P device GPT-OSS is refused before the model is built: no vllm-ascend release passes the sinks to
  the 310P attention (matrix capability ``atlas_310p``). The device is the 310P build of the wheel
  (``vllm_ascend/_build_info.py``) on a 310P SoC (the simulator answers ``get_soc_version() == 200``, an Atlas
  310P3, under ``GPTOSS_PATCH_SIM_SOC_VERSION=200``); vllm-ascend's own ``is_310p`` decides, as in each release.
* With the patches applied, an attention impl of a subclass that overrides the patched method (0.14.0rc1's
  ``AscendAttentionBackendImpl310.forward_impl``) is named by :func:`gptoss_patch.patches.guard.unpatched_in_use`;
  the base class's impl is not (negative control).
"""

import json
import subprocess
import sys

import pytest
from guard_cases import test_a_patched_function_rebound_to_upstreams_is_named  # noqa: F401
from test_main_job import BUILD_MODEL, _env, _result

#: What the 310P build of each vllm-ascend wheel ships in ``vllm_ascend/_build_info.py``: ``__soc_version__`` (0.11.x,
#: read by ``is_310p``) or ``__device_type__`` (0.12+, ``AscendDeviceType`` member name, checked against the SoC by
#: ``check_ascend_device_type``).
_310P_BUILD_INFO = (
    "import vllm_ascend._build_info as _bi\n"
    "_bi.__soc_version__ = 'ASCEND310P3'\n"
    "_bi.__device_type__ = '_310P'\n")


def test_gpt_oss_is_refused_before_the_build_on_an_atlas_310p(tmp_path, layout):
    proc = subprocess.run([sys.executable, "-c", BUILD_MODEL.format(prelude=_310P_BUILD_INFO), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=900,
                          env=_env(GPTOSS_PATCH_SIM_SOC_VERSION="200"))
    result = _result(proc, "GUARD-RESULT")
    assert result.startswith("GptOssNotPatchedError"), result
    assert "refused: atlas_310p" in result and "(in use: an Atlas 310P device)" in result
    assert "Atlas A2/A3" in result  # what to do


@pytest.mark.xdist_group("guard_child")
def test_the_same_build_on_an_atlas_a2_is_not_refused(a2_child):
    """Negative control for the test above: the same script with the A2 SoC builds the model."""
    assert _result(a2_child, "GUARD-RESULT") == "built"


SUBCLASS_RUN = """
import json, importlib
import torch
from gptoss_patch_testkit import npu_sim
npu_sim.install()
import gptoss_patch
from gptoss_patch.patches import guard
base_mod = importlib.import_module("vllm_ascend.attention.attention_v1")
base = base_mod.AscendAttentionBackendImpl
status = gptoss_patch.status()
patch = next(p for p in status.patches if p.name.startswith("attention.sink_window_forward"))
method = patch.target.rsplit(".", 1)[1]  # forward (0.11.x) or forward_impl (0.12+)

def own(self, *args, **kwargs):  # a third-party backend's override
    raise AssertionError("never called")

third_party = type("ThirdPartyImpl", (base,), {method: own})

def tree(impl_cls):
    layer = torch.nn.Module()
    layer.impl = object.__new__(impl_cls)  # the class decides which method runs; no state is needed
    model = torch.nn.Module()
    model.add_module("attn", layer)
    return model

out = {"patch": patch.name, "state": patch.state, "method": method,
       "base": guard.unpatched_in_use(tree(base), status.patches),
       "third_party": guard.unpatched_in_use(tree(third_party), status.patches)}
try:
    sub = importlib.import_module("vllm_ascend._310p.attention.attention_v1").AscendAttentionBackendImpl310
    out["p310"] = guard.unpatched_in_use(tree(sub), status.patches)
    out["p310_classes"] = guard.p310_in_use(tree(sub))
    out["base_classes"] = guard.p310_in_use(tree(base))
except ImportError as exc:
    out["p310_missing"] = str(exc)
print("SUBCLASS-RESULT " + json.dumps(out))
"""


@pytest.mark.xdist_group("guard_child")
def test_a_subclass_that_overrides_the_patched_method_is_named(layout, a2_child):
    """Any subclass of the patched impl class that overrides the patched method bypasses our wrapper: a third-party
    one in every layout, and on 0.14.0rc1 (layout F) vllm-ascend's own 310P impl. The base class is not named."""
    out = json.loads(_result(a2_child, "SUBCLASS-RESULT"))
    assert out["state"] == "applied" and out["method"] == ("forward" if layout == "B" else "forward_impl")
    assert out["base"] == []
    assert len(out["third_party"]) == 1 and out["third_party"][0].startswith(f"{out['patch']}: layer attn runs ")
    assert f"ThirdPartyImpl.{out['method']}" in out["third_party"][0]
    if layout == "F":
        assert len(out["p310"]) == 1 and "AscendAttentionBackendImpl310.forward_impl" in out["p310"][0]
        assert out["p310_classes"] == ["atlas_310p: layer attn runs "
                                       "vllm_ascend._310p.attention.attention_v1.AscendAttentionBackendImpl310"]
        assert out["base_classes"] == []
    else:  # the _310p attention package exists from 0.14.0rc1 on
        assert "p310_missing" in out


_RESHAPE_SINKS = """
import glob
from safetensors.torch import load_file, save_file
ckpt = write_checkpoint(sys.argv[1], preset="tiny", seed=0, tokenizer=False)
for shard in glob.glob(str(ckpt / "*.safetensors")):
    tensors = load_file(shard)
    if "model.layers.0.self_attn.sinks" in tensors:
        tensors["model.layers.0.self_attn.sinks"] = tensors["model.layers.0.self_attn.sinks"].reshape(-1, 1)
        save_file(tensors, shard, metadata={{"format": "pt"}})
"""


@pytest.mark.xdist_group("guard_child")
def test_a_wrong_shaped_checkpoint_tensor_is_named_before_loading(a2_child):
    """Sinks saved as ``[N, 1]``: the guard names the tensor, its shape and the expected one from the safetensors
    headers, instead of vLLM's broadcast error deep in the loader."""
    result = _result(a2_child, "RESHAPED-RESULT")
    assert result.startswith("GptOssCheckpointError"), result
    assert "model.layers.0.self_attn.sinks: shape [8, 1], expected [8]" in result


CONTEXT_PARALLEL = """
import json, sys
from gptoss_patch_testkit import npu_sim
npu_sim.install()
import gptoss_patch
from gptoss_patch.patches import guard
from gptoss_patch.selftest import worker as vllm_setup
from gptoss_patch.selftest.tiny import write_checkpoint
ckpt = write_checkpoint(sys.argv[1], preset="tiny", seed=0, tokenizer=False)
out = {}
for label, extra in (("tp2", {}), ("tp2_dcp2", {"decode_context_parallel_size": 2})):
    conf = vllm_setup.engine_config(ckpt, tensor_parallel_size=2, **extra)
    try:
        guard.check_capabilities(gptoss_patch.status(), conf)  # what the guard runs before GptOssForCausalLM builds
        out[label] = "passes"
    except guard.GptOssNotPatchedError as exc:
        out[label] = str(exc)
print("CP-RESULT " + json.dumps(out))
"""


@pytest.mark.xdist_group("guard_child")
def test_context_parallelism_is_refused_before_the_build(a2_child):
    """``--decode-context-parallel-size 2`` with TP 2 (a real ``VllmConfig`` of this cell's vLLM): the layers would run
    vllm-ascend's context-parallel attention impl (0.12+: ``AscendAttentionCPImpl``, its own ``forward_impl`` without
    sinks, so our wrapper never runs; 0.11: none at all), and the guard refuses naming the setting. TP 2 alone passes."""
    out = json.loads(_result(a2_child, "CP-RESULT"))
    assert out["tp2"] == "passes"
    assert out["tp2_dcp2"].startswith("refusing to build a GPT-OSS model"), out
    assert "refused: context_parallel" in out["tp2_dcp2"]
    assert "(in use: decode_context_parallel_size 2)" in out["tp2_dcp2"]


#: Runs the parts of :func:`a2_child` one after the other, each in its own namespace and with its own checkpoint
#: directory (``sys.argv[1]`` = ``<root>/<name>``); a part that raises prints ``<TAG> CRASH <error>`` and the next
#: part still runs, so one part's failure shows under its own tag only.
PARTS_DRIVER = """
import json, os, sys, traceback
root, parts = sys.argv[1], json.loads(sys.argv[2])
for tag, name, code in parts:
    sys.argv[1:] = [os.path.join(root, name)]
    try:
        exec(compile(code, "<guard part " + name + ">", "exec"), {"__name__": "__main__"})
    except BaseException as exc:
        print(tag + " CRASH " + (type(exc).__name__ + ": " + str(exc)).replace(chr(10), " | "))
        traceback.print_exc()
"""


@pytest.fixture(scope="module")
def a2_child(tmp_path_factory):
    """One fresh interpreter (activation through the installed .pth only, the default Atlas A2 SoC) that runs, one
    after the other and each with its own checkpoint directory and namespace (:data:`PARTS_DRIVER`), the A2 build
    (``GUARD-RESULT``), the subclass check (``SUBCLASS-RESULT``), the build of a checkpoint with wrong-shaped sinks
    (``RESHAPED-RESULT``) and the context-parallel configurations (``CP-RESULT``): four interpreter start-ups of
    ~12 s each become one. The tests that use it carry ``xdist_group("guard_child")``, so one worker runs it once.
    The Atlas 310P build keeps its own interpreter (its SoC and its ``_build_info`` differ)."""
    reshaped = BUILD_MODEL.replace("ckpt = write_checkpoint(sys.argv[1], preset=\"tiny\", seed=0, tokenizer=False)\n",
                                   _RESHAPE_SINKS).replace("GUARD-RESULT", "RESHAPED-RESULT")
    assert reshaped.count("RESHAPED-RESULT") == 2 and "load_file" in reshaped
    parts = [("GUARD-RESULT", "a2", BUILD_MODEL.format(prelude="")), ("SUBCLASS-RESULT", "subclass", SUBCLASS_RUN),
             ("RESHAPED-RESULT", "reshaped", reshaped.format(prelude="")), ("CP-RESULT", "cp", CONTEXT_PARALLEL)]
    return subprocess.run([sys.executable, "-c", PARTS_DRIVER, str(tmp_path_factory.mktemp("guard")),
                           json.dumps(parts)], capture_output=True, text=True, timeout=1200,
                          env=_env(GPTOSS_PATCH_SIM_SOC_VERSION="220"))
