"""Capability ``attention_graph``: GPT-OSS attention under FULL_DECODE_ONLY ACL graphs - the capture of decode
attention as one updatable task (:mod:`.capture`) and the per-step parameter update that re-issues it with each step's
lengths (:mod:`.update`, whose ``PATCHES`` are the capability's)."""
