"""``vllm.general_plugins`` entry point.

vLLM calls every general plugin in every vLLM process (API server, engine core, workers) through
``vllm.plugins.load_general_plugins`` (``vllm/plugins/__init__.py``). Users who set
``VLLM_PLUGINS`` may filter it out, which is why the ``.pth`` start-up hook exists too; both call
the same idempotent :func:`gptoss_patch.activate`.
"""

from __future__ import annotations


def register() -> None:
    """Entry point: activate gptoss-patch in this vLLM process. Never raises (vLLM would abort start-up)."""
    try:
        import gptoss_patch

        gptoss_patch.activate(source="vllm-plugin")
    except Exception as exc:  # noqa: BLE001
        import sys

        sys.stderr.write(f"gptoss-patch: plugin activation failed ({type(exc).__name__}: {exc})\n")
