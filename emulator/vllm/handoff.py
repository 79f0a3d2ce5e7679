"""The NixlConnector P/D handoff, both sides. Prefill: hold the prompt's blocks for the decode
(a lease) and answer ``kv_transfer_params`` pointing at them (with the faults that spoil them).
Decode: read the blocks from ``remote_host:remote_port``, or only notify the prefill (a request
computing its prompt itself)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from emulator.faults import Fault
from emulator.kvclient import notify_done, pull_blocks
from emulator.kvtransfer import Held, TransferError
from emulator.scheduler import Seq
from emulator.server import EmulatorServer

LEASE_S = 30.0
# prefill-side faults that spoil the handoff (the first one drawn acts)
_HOLD_FAULTS = ("transfer_fail", "transfer_stall", "abort_during_transfer", "wrong_request_kv")


def make_params(server: EmulatorServer, seq: Seq, request_id: str, blocks: list[int]) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [blocks],
        "remote_engine_id": server.engine_id,
        "remote_request_id": request_id,
        "remote_host": server.advertised_host,
        "remote_port": server.kv_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": len(seq.prompt),
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": seq.cached_tokens,
    }


class Handoffs:
    """A prefill's handoffs: `recent` keeps the last few params handed out (``stale_kv_params``
    hands out one of them again)."""

    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.recent: list[dict[str, Any]] = []

    def hold(self, seq: Seq, request_id: str, hit: dict[str, Fault]) -> dict[str, Any]:
        """Keep `seq`'s prompt blocks for its decode (a lease of :data:`LEASE_S`) and answer the
        `kv_transfer_params` that point at them."""
        s, engine = self.s, self.s.engine
        seq.kv_valid = seq.kv_valid and "silent_truncation" not in hit
        blocks = engine.release(seq, keep_prompt=True)
        assert s.kv_server is not None
        fault = next((k for k in _HOLD_FAULTS if k in hit), None)

        def expired() -> None:
            engine.counters.kv_expired += 1

        s.kv_server.hold(request_id, Held(blocks, len(seq.prompt), fault), LEASE_S, expired)
        params = make_params(s, seq, request_id, blocks)
        if "stale_kv_params" in hit and self.recent:
            params = dict(self.recent[-1])
        bogus = hit.get("bogus_kv_params")
        if bogus is not None:
            params = self._bogus(params, blocks, bogus.get_str("mode", "range"))
        self.recent.append(make_params(s, seq, request_id, blocks))
        del self.recent[:-4]
        return params

    def _bogus(self, params: dict[str, Any], blocks: list[int], mode: str) -> dict[str, Any]:
        params = dict(params)
        if mode == "empty":
            params["remote_block_ids"] = [[]]
        elif mode == "short":
            params["remote_block_ids"] = [blocks[:1]]
        elif mode == "engine":
            params["remote_engine_id"] = "00000000-0000-0000-0000-000000000000"
        else:
            num_blocks = self.s.engine.pool.num_blocks
            params["remote_block_ids"] = [[num_blocks + 9999 + i for i in range(len(blocks))]]
        return params


async def pull_kv(
    server: EmulatorServer, seq: Seq, params: dict[str, object], hit: dict[str, Fault]
) -> list[bytes]:
    """vLLM decode: read the prefill's blocks from ``remote_host:remote_port``."""
    c = server.engine.counters
    c.in_transfer += 1
    try:
        if "transfer_stall" in hit:
            await asyncio.Event().wait()
        if "transfer_fail" in hit or server.concurrency_fault(c.in_transfer):
            raise TransferError("failed", "KV transfer failed (injected)")
        groups = params.get("remote_block_ids") or [[]]
        assert isinstance(groups, list)
        ids = [int(b) for b in groups[0]]
        needed = seq.n_prompt_blocks
        return await pull_blocks(
            str(params.get("remote_host") or "127.0.0.1"),
            int(str(params.get("remote_port") or 0)),
            engine_id=str(params.get("remote_engine_id")),
            request_id=str(params.get("remote_request_id")),
            block_ids=ids[:needed],
            num_tokens=len(seq.prompt) - seq.cached_tokens,
            connect_retry_s=server.spec.handshake_timeout_s,
        )
    finally:
        c.in_transfer -= 1


async def skip_remote_kv(server: EmulatorServer, params: dict[str, object]) -> None:
    """vLLM decode computing the prompt itself (prompt logprobs skip reading any cache): nothing
    is pulled, the prefill is only notified so that it frees the blocks it holds. A failed
    notification is only logged by vLLM (the blocks then wait for their lease)."""
    with contextlib.suppress(TransferError):
        await notify_done(
            str(params.get("remote_host") or "127.0.0.1"),
            int(str(params.get("remote_port") or 0)),
            engine_id=str(params.get("remote_engine_id")),
            request_id=str(params.get("remote_request_id")),
            wait_s=server.spec.handshake_timeout_s,
        )
