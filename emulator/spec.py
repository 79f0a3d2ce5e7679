"""What one emulated server is: the ``pd-gateway emulate`` flags as a msgspec Struct."""

from __future__ import annotations

from typing import Literal

import msgspec

from emulator.profiles import DEFAULT_PROFILE


class EmulatorSpec(msgspec.Struct, kw_only=True):
    """The same fields as the ``pd-gateway emulate`` flags (plus a few emulator knobs)."""

    engine: Literal["sglang", "vllm"]
    role: Literal["prefill", "decode", "both"]
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = None
    kv_port: int | None = None
    model: str = "meta-llama/Meta-Llama-3-8B-Instruct"
    profile: str = DEFAULT_PROFILE
    time_scale: float = 0.0
    faults: list[str] = []
    kv_events: str | None = None
    max_model_len: int = 8192
    seed: int = 0
    # emulator knobs (flags --max-total-tokens, --block-size, --kv-scale, --waiting-timeout,
    # --handshake-timeout, --stream-interval)
    max_total_tokens: int | None = None
    block_size: int | None = None
    kv_scale: int = 1024
    waiting_timeout_s: float | None = None
    handshake_timeout_s: float = 5.0
    stream_interval: int = 1  # SGLang's --stream-interval: tokens per stream event
    # --stop-checks-first (vLLM): judge a sequence's stop token ids before its length cap, as
    # newer vLLM's check_stop does (0.32 caps length first), behind a connector that hands over KV
    # only for a prefill capped by length (Mooncake's rule): a P/D prefill (max_tokens 1) whose
    # one token is a stop id then ends "stop" and hands over no KV (kv_transfer_params null)
    stop_checks_first: bool = False
    max_logprobs: int = 20  # vLLM's --max-logprobs (its default): a request asking more is refused
    # --enable-cache-report (SGLang's flag): the OpenAI routes' usage has
    # `prompt_tokens_details.cached_tokens` when the prompt found cached tokens
    enable_cache_report: bool = False
    # --enable-prompt-tokens-details (vLLM's flag): its usage has
    # `prompt_tokens_details.cached_tokens` when the prompt found cached tokens
    enable_prompt_tokens_details: bool = False
    # --ssl-certfile / --ssl-keyfile (both engines' flags): the HTTP API over TLS (the bootstrap
    # and KV ports stay plain)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # --api-key (both engines' flag): requests must carry `Authorization: Bearer KEY` (emulator/auth.py)
    api_key: str | None = None

    def to_argv(self) -> list[str]:
        argv = ["--engine", self.engine, "--role", self.role, "--host", self.host, "--port", str(self.port)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        if self.kv_port is not None:
            argv += ["--kv-port", str(self.kv_port)]
        argv += ["--model", self.model, "--profile", self.profile, "--time-scale", repr(self.time_scale)]
        for f in self.faults:
            argv += ["--fault", f]
        if self.kv_events:
            argv += ["--kv-events", self.kv_events]
        argv += ["--max-model-len", str(self.max_model_len), "--seed", str(self.seed)]
        if self.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.block_size is not None:
            argv += ["--block-size", str(self.block_size)]
        argv += ["--kv-scale", str(self.kv_scale), "--handshake-timeout", repr(self.handshake_timeout_s)]
        if self.waiting_timeout_s is not None:
            argv += ["--waiting-timeout", repr(self.waiting_timeout_s)]
        if self.stream_interval != 1:
            argv += ["--stream-interval", str(self.stream_interval)]
        if self.stop_checks_first:
            argv.append("--stop-checks-first")
        if self.max_logprobs != 20:
            argv += ["--max-logprobs", str(self.max_logprobs)]
        if self.enable_cache_report:
            argv.append("--enable-cache-report")
        if self.enable_prompt_tokens_details:
            argv.append("--enable-prompt-tokens-details")
        if self.ssl_certfile is not None:
            argv += ["--ssl-certfile", self.ssl_certfile]
        if self.ssl_keyfile is not None:
            argv += ["--ssl-keyfile", self.ssl_keyfile]
        if self.api_key is not None:
            argv += ["--api-key", self.api_key]
        return argv
