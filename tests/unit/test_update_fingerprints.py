"""scripts/update_fingerprints.py when a release cannot be downloaded (issue 17): one error line naming the release,
exit 1, no traceback, the stored table untouched."""

import subprocess
import sys

from conftest import ROOT, clean_env


def test_unreachable_index_is_one_error_naming_the_release(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://127.0.0.1:9/simple\nretries = 0\ntimeout = 2\n")
    table = ROOT / "gptoss_patch" / "upstream_fingerprints.json"
    before = table.read_bytes()
    env = clean_env(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="", PIP_NO_INDEX="")
    env = {k: v for k, v in env.items() if v != "" and not k.startswith(("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                                             "https_proxy"))}
    proc = subprocess.run([sys.executable, "scripts/update_fingerprints.py", "--wheels", str(tmp_path / "wheels")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: vllm-ascend 0.11.0rc0: its wheel (or sdist) could not be downloaded"), \
        proc.stderr
    assert "nothing was written" in proc.stderr
    assert table.read_bytes() == before
