"""SGLang 0.5.23's HTTP surface and P/D handoff (:class:`emulator.sglang.api.SglangApi`)."""
