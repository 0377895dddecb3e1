"""The `vllm` backend (imports vLLM lazily: only `backend.VllmBackend.start` and `engine_side` load it)."""
