"""The math of the patched paths in plain torch, apart from the NPU-operator adapters."""
