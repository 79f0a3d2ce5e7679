"""`pd-gateway serve`: run the gateway from flags and/or a TOML file."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from gateway.app import Gateway, run_forever
from gateway.cli_args import parse_serve_command
from gateway.config import ConfigError
from gateway.listen import ListenError
from gateway.logging import configure, get_logger
from policies.build import PolicyBuildError


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def raise_open_files_limit() -> tuple[int, int] | None:
    """Lift this process's soft limit on open files to its hard limit, as Go's runtime does for
    every server and nginx's `worker_rlimit_nofile` is set for: each request in flight holds its
    client's socket and one or two upstream ones, and a soft limit of 1024 (a common default)
    would refuse connections from a few hundred P/D requests on. (before, after) when raised."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return None
        return soft, want
    return None


def main(argv: Sequence[str]) -> int:
    try:
        return _serve(argv)
    except KeyboardInterrupt:  # a SIGINT before `run_forever` took the signals over: as one after
        get_logger("pd_gateway").info(
            "gateway.interrupted", reason="signal during start-up, before listening"
        )
        return 0


def _serve(argv: Sequence[str]) -> int:
    try:
        cfg, notes = parse_serve_command(list(argv))
    except ConfigError as e:
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    for note in notes:  # router flags (sglang-router / vllm-router) ignored or mapped loosely
        print(f"pd-gateway serve: note: {note}", file=sys.stderr)
    if not cfg.workers and cfg.kubernetes is None:
        print(
            "pd-gateway serve: no workers; give --prefill/--decode/--worker, a --config file "
            "or Kubernetes discovery ([kubernetes], --service-discovery)",
            file=sys.stderr,
        )
        return 2
    configure(cfg.log_level, cfg.log_json)
    try:
        gw = Gateway(cfg)  # reads api_key_env / admin.token_env, loads policy plugins
    except (ConfigError, PolicyBuildError) as e:
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    if cfg.listen.processes > 1:
        # the gateway above only checked the config: each process builds its own after the fork
        del gw
        from gateway.multiprocess import supervisor

        return supervisor.run(cfg)
    install_uvloop()
    raised = raise_open_files_limit()
    if raised is not None:
        get_logger("gateway").info("open_files_limit.raised", before=raised[0], now=raised[1])
    try:
        asyncio.run(run_forever(gw, cfg.shutdown_grace_s))
    except (ListenError, ConfigError) as e:  # found before any worker is probed
        print(f"pd-gateway serve: {e}", file=sys.stderr)
        return 2
    return 0
