"""An emulator spec survives the trip through its command line (how `pd-gateway demo`, the
benchmarks and the subprocess tests start emulators)."""

from __future__ import annotations

import msgspec

from emulator.api import EmulatorSpec
from emulator.cli import build_parser, spec_from_args


def test_every_knob_survives_the_command_line() -> None:
    spec = EmulatorSpec(
        engine="vllm",
        role="prefill",
        port=8100,
        kv_port=0,
        model="m",
        time_scale=0.5,
        faults=["slow:0.5"],
        max_model_len=4096,
        seed=3,
        max_total_tokens=10000,
        block_size=32,
        kv_scale=64,
        waiting_timeout_s=5.0,
        handshake_timeout_s=2.0,
        stream_interval=4,
        stop_checks_first=True,
        api_key="k",
    )
    back = spec_from_args(build_parser().parse_args(spec.to_argv()))
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(spec)
