"""`pd-gateway serve`: run the gateway from flags and/or a TOML file."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from gateway.app import Gateway, ListenError, run_forever
from gateway.cli_args import parse_serve_args
from gateway.config import ConfigError
from gateway.logging import configure
from policies.build import PolicyBuildError


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str]) -> int:
    try:
        cfg = parse_serve_args(list(argv))
    except ConfigError as e:
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    if not cfg.workers:
        print(
            "pd-gateway serve: no workers; give --prefill/--decode/--worker or a --config file",
            file=sys.stderr,
        )
        return 2
    configure(cfg.log_level, cfg.log_json)
    try:
        gw = Gateway(cfg)  # reads api_key_env / admin.token_env, loads policy plugins
    except (ConfigError, PolicyBuildError) as e:
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    install_uvloop()
    try:
        asyncio.run(run_forever(gw, cfg.shutdown_grace_s))
    except (ListenError, ConfigError) as e:  # found before any worker is probed
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    return 0
