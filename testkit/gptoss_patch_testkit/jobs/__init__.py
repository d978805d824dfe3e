"""The main job and its helpers: :mod:`.serve_job` (``vllm serve`` on the simulated NPU, asked over HTTP, tokens
compared with transformers), :mod:`.main_job` (the same model through our runner in a child process) and
:mod:`.runner` (that runner)."""
