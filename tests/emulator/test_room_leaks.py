"""Every way a P/D request ends releases what it holds: an SGLang prefill's bootstrap room (done,
cancelled by its client, aborted with ``/abort_request``, refused, failed by a fault, or its decode
gone first), the decode's claim on a room, and a vLLM prefill's held blocks when its decode ends
before reading them. ``stats()`` and ``/v1/loads`` then show nothing in flight."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from emulator.api import EmulatorHandle
from emulator.kvtransfer import PEER_ABORTED
from tests.emulator.conftest import Factory
from tests.emulator.test_vllm import PREFILL_KTP

BODY: dict[str, Any] = {
    "text": "The quick brown fox jumps over the lazy dog",
    "sampling_params": {"temperature": 0, "max_new_tokens": 4},
}


def boot(p: EmulatorHandle, room: int | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": room if room is not None else random.getrandbits(63),
    }


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], total_s: float = 5.0
) -> tuple[int, str]:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=total_s)) as r:
        return r.status, await r.text()


async def gone(http: aiohttp.ClientSession, url: str, body: dict[str, Any], total_s: float) -> None:
    """A client that gives up after `total_s` (or whose connection the server drops)."""
    with pytest.raises((TimeoutError, aiohttp.ClientError)):
        await post(http, url, body, total_s)


async def until(h: EmulatorHandle, key: str, value: int, within_s: float = 2.0) -> None:
    for _ in range(int(within_s / 0.02)):
        if (await h.stats())[key] == value:
            return
        await asyncio.sleep(0.02)
    assert (await h.stats())[key] == value, await h.stats()


async def settled(http: aiohttp.ClientSession, *hs: EmulatorHandle) -> None:
    """Nothing pending anywhere: no room, no held transfer, no running request, no KV in use."""
    for h in hs:
        await until(h, "pending_rooms", 0)
        await until(h, "in_flight", 0)
        await until(h, "held_transfers", 0)  # a decode's notification may still be on its way
        st = await h.stats()
        assert st["held_transfers"] == 0 and st["running"] == 0 and st["kv_blocks_used"] == 0, st
        if h.server.kv_server is not None:
            assert h.server.kv_server.active == 0, "a KV send is still running"
        if h.server.engine_name != "sglang":
            continue
        async with http.get(h.url + "/v1/loads") as r:
            load = (await r.json())["loads"][0]
        dis = load.get("disaggregation") or {}
        assert dis.get("prefill_inflight_queue_reqs", 0) == 0, load
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load


async def pair(
    emu: Factory, pfaults: list[str] | None = None, dfaults: list[str] | None = None, **dkw: Any
) -> tuple[Any, Any]:
    p = await emu("sglang", "prefill", faults=pfaults or [])
    d = await emu("sglang", "decode", faults=dfaults or [], **dkw)
    return p, d


# ----------------------------------------------------------------------------- SGLang prefill
async def test_prefill_cancelled_by_client(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pair(emu)
    b = {**BODY, **boot(p)}
    await gone(http, p.url + "/generate", b, 0.3)  # waits for a decode that never comes
    await settled(http, p, d)
    # a stream too
    await gone(
        http, p.url + "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True, **boot(p)}, 0.3
    )
    await settled(http, p, d)


async def test_prefill_aborted(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pair(emu)
    b = {**BODY, **boot(p), "rid": "abort-me"}
    task = asyncio.ensure_future(post(http, p.url + "/generate", b, 3.0))
    await until(p, "pending_rooms", 1)
    async with http.post(p.url + "/abort_request", json={"rid": "abort-me"}) as r:
        assert r.status == 200
    st, text = await task  # answered at once, not after the bootstrap timeout
    assert st == 200 and json.loads(text)["meta_info"]["finish_reason"]["type"] == "abort", text
    await settled(http, p, d)
    # abort_all too
    task = asyncio.ensure_future(post(http, p.url + "/generate", {**BODY, **boot(p)}, 3.0))
    await until(p, "pending_rooms", 1)
    async with http.post(p.url + "/abort_request", json={"abort_all": True}) as r:
        assert r.status == 200
    await task
    await settled(http, p, d)


async def test_decode_gone_before_prefill(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pair(emu)
    room = random.getrandbits(63)
    b = {**BODY, **boot(p, room)}
    # the decode's client gives up while the decode waits for a prefill that has not come
    await gone(http, d.url + "/generate", b, 0.3)
    await settled(http, p, d)
    # the prefill arriving later finds its decode gone: it ends at once, with SGLang's 500 abort
    # (the abort notification left the room Failed: handle_bootstrap_failure), and holds nothing
    st, text = await post(http, p.url + "/generate", {**b, "rid": "late"}, 2.0)
    assert st == 500 and prefill_failure("bootstrap", "late", room, PEER_ABORTED) in text, text
    await settled(http, p, d)


def prefill_failure(stage: str, rid: str, room: int, reason: str) -> str:
    """A failed SGLang prefill's abort message (disaggregation/prefill.py:1282-1310, 1352-1378)."""
    return (
        f"Prefill {stage} failed for request rank=0 req.rid='{rid}' req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): {reason}"
    )


@pytest.mark.parametrize(
    ("pfault", "status", "stage", "reason"),
    [
        ("transfer_stall", 500, "transfer", PEER_ABORTED),  # the decode times out and aborts
        ("transfer_fail", 500, "transfer", "KV transfer failed (injected)"),
        ("abort_during_transfer", 200, "", ""),  # sglang #33507: the failure goes unseen
    ],
)
async def test_prefill_answers_its_failed_transfer(
    emu: Factory, http: aiohttp.ClientSession, pfault: str, status: int, stage: str, reason: str
) -> None:
    """A prefill whose KV never reached its decode ends with a 500 abort naming why, not a 200."""
    p, d = await pair(emu, [pfault], waiting_timeout_s=0.3)
    room = random.getrandbits(63)
    b = {**BODY, **boot(p, room), "rid": "r1"}
    (ps, ptext), (ds, _) = await asyncio.gather(
        post(http, p.url + "/generate", b), post(http, d.url + "/generate", b)
    )
    assert ps == status, ptext
    if status == 500:
        assert ds == 500 and prefill_failure(stage, "r1", room, reason) in ptext, ptext
    await settled(http, p, d)


async def test_prefill_without_decode_times_out_bootstrapping(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("sglang", "prefill", waiting_timeout_s=0.2)
    room = random.getrandbits(63)
    st, text = await post(http, p.url + "/generate", {**BODY, **boot(p, room), "rid": "alone"})
    reason = f"Request {room} timed out after 0.2s in KVPoll.Bootstrapping"
    assert st == 500 and prefill_failure("bootstrap", "alone", room, reason) in text, text
    await settled(http, p)


async def test_decode_aborted_while_waiting(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pair(emu)
    b = {**BODY, **boot(p), "rid": "d1"}
    dtask = asyncio.ensure_future(post(http, d.url + "/generate", b, 3.0))
    await until(p, "pending_rooms", 1)  # the decode's wait registered the room
    async with http.post(d.url + "/abort_request", json={"rid": "d1"}) as r:
        assert r.status == 200
    st, _ = await dtask
    assert st == 200
    await settled(http, p, d)


async def test_prefill_refused_decode_times_out(emu: Factory, http: aiohttp.ClientSession) -> None:
    """The prefill's scheduler refuses the prompt (too long for it): its room is never offered,
    the decode waits for its own timeout (as on SGLang 0.5.23), and then nothing is left."""
    p, d = await pair(emu, waiting_timeout_s=0.3)
    body: dict[str, Any] = {"input_ids": [1] * 8188, "sampling_params": {"max_new_tokens": 1}}
    b = {**body, **boot(p)}
    (ps, _), (ds, dtext) = await asyncio.gather(
        post(http, p.url + "/generate", b), post(http, d.url + "/generate", b)
    )
    assert ps == 400 and ds == 500 and "timed out" in dtext, (ps, ds, dtext)
    await settled(http, p, d)


@pytest.mark.parametrize(
    ("pfaults", "dfaults", "decode_waits"),
    [
        (["crash_mid_stream,after=1"], [], False),
        (["crash_mid_stream,after=0"], [], False),
        (["hang_mid_stream,after=1"], [], False),
        (["http_error"], [], True),
        (["hang_before_first_byte"], [], True),
        (["transfer_stall"], [], True),
        (["transfer_fail"], [], True),
        (["abort_during_transfer"], [], True),
        ([], ["transfer_stall"], True),
        ([], ["transfer_fail"], True),
        ([], ["abort_during_transfer"], True),
        (["silent_truncation"], [], True),
    ],
)
async def test_faults_release_rooms(
    emu: Factory, http: aiohttp.ClientSession, pfaults: list[str], dfaults: list[str], decode_waits: bool
) -> None:
    p, d = await pair(emu, pfaults, dfaults, waiting_timeout_s=0.3)
    for _ in range(3):
        b = {**BODY, **boot(p)}
        pt = asyncio.ensure_future(gone_or_answer(http, p.url + "/generate", b))
        if decode_waits:
            await gone_or_answer(http, d.url + "/generate", b)
        await pt
        await settled(http, p, d)


async def gone_or_answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    try:
        await post(http, url, body, 1.0)
    except (TimeoutError, aiohttp.ClientError):
        pass


async def test_silent_truncation_room_expires_without_decode(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("sglang", "prefill", faults=["silent_truncation"], waiting_timeout_s=0.2)
    st, _ = await post(http, p.url + "/generate", {**BODY, **boot(p)})
    assert st == 400
    assert (await p.stats())["pending_rooms"] == 1  # kept for its decode (SGLang #30233) ...
    await settled(http, p)  # ... until the bootstrap timeout


async def test_many_pd_requests_leave_nothing(emu: Factory, http: aiohttp.ClientSession) -> None:
    p, d = await pair(emu)
    for i in range(5):
        b = {**BODY, **boot(p)}
        await asyncio.gather(post(http, p.url + "/generate", b), post(http, d.url + "/generate", b))
        await gone(http, p.url + "/generate", {**b, "bootstrap_room": i}, 0.1)
        await gone(http, d.url + "/generate", {**b, "bootstrap_room": 1000 + i}, 0.1)
    await settled(http, p, d)


# ----------------------------------------------------------------------------- vLLM
async def vllm_prefill(
    http: aiohttp.ClientSession, p: EmulatorHandle, body: dict[str, Any]
) -> dict[str, Any]:
    async with http.post(
        p.url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KTP}
    ) as r:
        assert r.status == 200
        return dict((await r.json())["kv_transfer_params"])


async def test_vllm_decode_refused_by_engine_frees_prefill_blocks(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode", max_total_tokens=64)
    body = {"prompt": "The capital of France is", "max_tokens": 200}
    ktp = await vllm_prefill(http, p, body)
    assert (await p.stats())["held_transfers"] == 1
    st, text = await post(http, d.url + "/v1/completions", {**body, "kv_transfer_params": ktp})
    assert st == 400 and "too many KV tokens" in text, text
    await settled(http, p, d)  # notified, not left to the lease


async def test_vllm_decode_aborted_before_pull_frees_prefill_blocks(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode", max_total_tokens=64, time_scale=1.0)
    # a request that holds the decode's whole pool, so the next one waits for admission
    busy = asyncio.ensure_future(post(http, d.url + "/v1/completions", {"prompt": "x", "max_tokens": 60}, 10))
    await until(d, "running", 1)
    body = {"prompt": "abc", "max_tokens": 2}
    ktp = await vllm_prefill(http, p, body)
    await gone(http, d.url + "/v1/completions", {**body, "kv_transfer_params": ktp}, 0.2)
    await until(p, "held_transfers", 0)
    st, _ = await busy
    assert st == 200
    await settled(http, p, d)


async def test_vllm_stalled_read_keeps_blocks_for_the_lease(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    p = await emu("vllm", "prefill", faults=["transfer_stall"])
    d = await emu("vllm", "decode")
    body = {"prompt": "abc", "max_tokens": 2}
    ktp = await vllm_prefill(http, p, body)
    await gone(http, d.url + "/v1/completions", {**body, "kv_transfer_params": ktp}, 0.3)
    await asyncio.sleep(0.1)
    # the read never completed: as on vLLM, the blocks wait for the abort timeout (the lease)
    assert (await p.stats())["held_transfers"] == 1
    assert p.server.kv_server.active == 0  # but the stalled send ended with its connection
