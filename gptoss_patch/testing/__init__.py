"""Test support shipped with gptoss-patch: the NPU simulator and tiny GPT-OSS checkpoints (used by tests and ``verify --simulate``)."""
