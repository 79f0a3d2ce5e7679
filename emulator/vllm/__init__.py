"""vLLM 0.32/0.33's OpenAI-compatible surface with the NixlConnector P/D handoff
(:class:`emulator.vllm.api.VllmApi`)."""
