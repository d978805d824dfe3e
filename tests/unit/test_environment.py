"""Versions as deployed: ``VLLM_VERSION`` (honoured as vllm-ascend honours it), tag-less source builds, several
``*.dist-info`` of one distribution. The installed versions come from real ``*.dist-info/METADATA`` files (what pip
writes) on ``sys.path``; nothing of vLLM is installed or imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import json
import gptoss_patch
from gptoss_patch import environment
v = environment.installed_versions()
st = gptoss_patch.activate(source="test")
print(json.dumps({"vllm": v.vllm, "vllm_installed": v.vllm_installed, "vllm_ascend": v.vllm_ascend,
                  "duplicates": v.duplicates, "decision": st.decision, "reason": st.reason, "row": st.row}))
"""


def _dist(root: Path, name: str, version: str) -> Path:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return info


def _probe(paths, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPTOSS_PATCH_", "VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_version_variable_is_the_vllm_version_as_vllm_ascend_reads_it(tmp_path):
    _dist(tmp_path, "vllm", "0.1.dev1+g1234abc")  # a source checkout built without tags
    _dist(tmp_path, "vllm-ascend", "0.11.0")
    bare = _probe([tmp_path])
    assert bare["vllm"] == "0.1.dev1+g1234abc" and bare["decision"] == "refuse"
    assert "without release tags" in bare["reason"] and "VLLM_VERSION" in bare["reason"]
    told = _probe([tmp_path], VLLM_VERSION="0.11.0")
    assert told["vllm"] == "0.11.0" and told["vllm_installed"] == "0.1.dev1+g1234abc"
    # placed as 0.11.0, but a declared version is never an exact tested pairing: both sides are read, and here
    # (metadata only, no code) nothing is there to read
    assert told["row"] == "0.11.0" and "tested release" not in told["reason"]
    assert told["decision"] == "refuse" and "untested build vllm-ascend 0.11.0 with vllm 0.11.0" in told["reason"]
    assert "vLLM side" in told["reason"]


def test_official_image_labels_are_the_release(tmp_path):
    _dist(tmp_path, "vllm", "0.11.0+empty")
    _dist(tmp_path, "vllm-ascend", "0.11.0")
    out = _probe([tmp_path])
    assert out["decision"] == "apply" and out["row"] == "0.11.0" and "tested release" in out["reason"]


def test_two_dist_infos_of_one_distribution_are_refused_naming_both(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _dist(a, "vllm", "0.11.0")
    first = _dist(a, "vllm-ascend", "0.11.0")
    second = _dist(b, "vllm-ascend", "0.13.0")
    out = _probe([a, b])
    assert out["decision"] == "refuse" and "several installations" in out["reason"]
    assert str(first) in out["reason"] and str(second) in out["reason"]
    assert list(out["duplicates"]) == ["vllm-ascend"]
    single = _probe([a])  # control: one of them alone is the tested release
    assert single["decision"] == "apply" and single["duplicates"] == {}


def test_an_editable_checkout_beside_its_own_dist_info_is_one_installation(tmp_path):
    """``pip install -e .`` leaves ``vllm_ascend.egg-info`` in the source tree beside the installed dist-info."""
    a, src = tmp_path / "site", tmp_path / "src"
    _dist(a, "vllm", "0.11.0")
    _dist(a, "vllm-ascend", "0.11.0")
    egg = src / "vllm_ascend.egg-info"
    egg.mkdir(parents=True)
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm-ascend\nVersion: 0.11.0\n")
    out = _probe([a, src])
    assert out["duplicates"] == {} and out["decision"] == "apply"
