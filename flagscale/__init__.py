"""FlagScale-compatible LLM serving orchestrator: one YAML -> Ray cluster -> Ray Serve graph -> vLLM engines."""
