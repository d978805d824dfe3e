"""gptoss_patch.report: what a bug-report file may contain from the environment (issue 17)."""

from gptoss_patch import report


def test_only_gptoss_patch_and_vllm_variables_and_no_secret_values():
    env = {"GPTOSS_PATCH_MOE_PAD": "always", "VLLM_WORKER_MULTIPROC_METHOD": "forkserver",
           "VLLM_API_KEY": "anything", "VLLM_HTTP_PROXY_URL": "http://alice:pw@proxy:3128",
           "VLLM_SOME_ID": "sk-abcdef0123456789", "VLLM_LONG": "A" * 40, "VLLM_PATH": "/opt/models/gpt-oss-120b",
           "HF_TOKEN": "hf_secret", "AWS_SECRET_ACCESS_KEY": "x", "PATH": "/usr/bin", "GPTOSS_PATCH_AUTH_HEADER": "b"}
    got = report.safe_environment(env)
    assert got == {"GPTOSS_PATCH_AUTH_HEADER": report.REDACTED, "GPTOSS_PATCH_MOE_PAD": "always",
                   "VLLM_API_KEY": report.REDACTED, "VLLM_HTTP_PROXY_URL": report.REDACTED,
                   "VLLM_LONG": report.REDACTED, "VLLM_PATH": "/opt/models/gpt-oss-120b",
                   "VLLM_SOME_ID": report.REDACTED, "VLLM_WORKER_MULTIPROC_METHOD": "forkserver"}


def test_render_of_a_minimal_report_names_every_section():
    text = report.render({"ok": False, "status": {"decision": "refuse", "reason": "not checked yet",
                                                  "versions": {"vllm_ascend": "0.99.0"}, "patches": []},
                          "problems": ["stack not covered: not checked yet"], "warnings": []},
                         argv=["--report", "r.md"], env={"VLLM_API_KEY": "k", "HOME": "/root"})
    for heading in ("## Versions", "## Decision", "## Patches", "## Self-test", "## Activation per process kind",
                    "## Interpreter", "## Environment", "## Problems", "## Warnings"):
        assert heading in text, heading
    assert "| vllm-ascend | 0.99.0 |" in text and "`refuse` - not checked yet" in text
    assert "- stack not covered: not checked yet" in text and "Result: **NOT OK**" in text
    assert "HOME" not in text and "| VLLM_API_KEY | `(set; value not shown)` |" in text
