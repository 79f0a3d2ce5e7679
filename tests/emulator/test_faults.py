from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from emulator.faults import FaultSet, FaultSpecError, parse_fault
from tests.emulator.conftest import Factory, sse_events
from tests.emulator.test_vllm import PREFILL_KTP, handoff, text_of

BODY = {
    "text": "The quick brown fox jumps over the lazy dog",
    "sampling_params": {"temperature": 0, "max_new_tokens": 10},
}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], total_s: float = 10
) -> tuple[int, str]:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=total_s)) as r:
        return r.status, await r.text()


def test_parse() -> None:
    f = parse_fault("transfer_fail_concurrent:0.5,over=64")
    assert (f.kind, f.fraction, f.get_int("over", 0)) == ("transfer_fail_concurrent", 0.5, 64)
    assert parse_fault("slow:1,factor=5").get_float("factor", 0) == 5.0
    for bad in ("nope", "slow:2", "slow,x", ""):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)
    fs = FaultSet(["http_error:0.3"], seed=1)
    hits = sum("http_error" in fs.draw() for _ in range(2000))
    assert 450 < hits < 750


async def sgl_pd(
    emu: Factory,
    http: aiohttp.ClientSession,
    pfaults: list[str],
    dfaults: list[str],
    body: dict[str, Any] = BODY,
    **dkw: Any,
) -> tuple[tuple[int, str], tuple[int, str], str]:
    single = await emu("sglang", "both")
    p = await emu("sglang", "prefill", faults=pfaults, **dkw)
    d = await emu("sglang", "decode", faults=dfaults, **dkw)
    _, ref = await post(http, single.url + "/generate", body)
    b = {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    pr, dr = await asyncio.gather(post(http, p.url + "/generate", b), post(http, d.url + "/generate", b))
    return pr, dr, ref


@pytest.mark.parametrize(
    "fault", ["silent_truncation", "stale_kv_params", "bogus_kv_params", "wrong_request_kv"]
)
async def test_sglang_corruption_changes_output(
    emu: Factory, http: aiohttp.ClientSession, fault: str
) -> None:
    single = await emu("sglang", "both")
    p = await emu("sglang", "prefill")
    d = await emu("sglang", "decode")
    other = {
        "text": "Another prompt entirely, shipped first",
        "sampling_params": {"temperature": 0, "max_new_tokens": 10},
    }
    for body in (other,):  # give the prefill an earlier request (stale / wrong_request_kv need one)
        b = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 1}
        await asyncio.gather(post(http, p.url + "/generate", b), post(http, d.url + "/generate", b))
    await p.set_faults([fault])
    _, ref = await post(http, single.url + "/generate", BODY)
    b = {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 2}
    (ps, ptext), (ds, dtext) = await asyncio.gather(
        post(http, p.url + "/generate", b), post(http, d.url + "/generate", b)
    )
    assert ds == 200
    assert json.loads(dtext)["output_ids"] != json.loads(ref)["output_ids"]
    if fault == "silent_truncation":
        assert ps == 400 and "exceeds the maximum allowed length" in ptext


@pytest.mark.parametrize("fault", ["silent_truncation", "stale_kv_params", "wrong_request_kv"])
async def test_vllm_corruption_changes_output(emu: Factory, http: aiohttp.ClientSession, fault: str) -> None:
    single = await emu("vllm", "both")
    p = await emu("vllm", "prefill")
    d = await emu("vllm", "decode")
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    await handoff(http, p, d, "/v1/completions", {"prompt": "Something else, earlier", "max_tokens": 2})
    await p.set_faults([fault])
    _, ref = await post(http, single.url + "/v1/completions", body)
    _, ds, dtext = await handoff(http, p, d, "/v1/completions", body)
    assert ds == 200 and text_of(json.loads(dtext)) != text_of(json.loads(ref))


async def test_vllm_bogus_params_range_and_empty(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("vllm", "prefill", faults=["bogus_kv_params"])
    d = await emu("vllm", "decode")
    _, ds, dtext = await handoff(http, p, d, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert ds == 500 and json.loads(dtext)["error"]["message"] == "Internal server error" and not d.dead
    await p.set_faults(["bogus_kv_params:1,mode=empty"])
    _, ds, dtext = await handoff(http, p, d, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert ds == 500 and "EngineCore" in dtext
    await asyncio.sleep(0.2)
    assert d.dead


async def test_http_error_and_admin(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("sglang", "both", faults=["http_error:1,status=503"])
    st, _ = await post(http, s.url + "/generate", BODY)
    assert st == 503
    async with http.post(s.url + "/emulator/faults", json=[]) as r:
        assert r.status == 200 and (await r.json())["faults"] == []
    st, _ = await post(http, s.url + "/generate", BODY)
    assert st == 200
    async with http.post(s.url + "/emulator/faults", json=["bad_kind"]) as r:
        assert r.status == 400
    async with http.get(s.url + "/emulator/stats") as r:
        stats = await r.json()
    for key in (
        "received",
        "in_flight",
        "completed",
        "aborted",
        "kv_transfers_ok",
        "kv_transfers_failed",
        "cached_tokens_total",
    ):
        assert key in stats
    assert stats["received"] == 2 and stats["completed"] == 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_hangs_and_crash(emu: Factory, http: aiohttp.ClientSession, engine: str) -> None:
    s = await emu(engine, "both")
    path = "/v1/completions"
    body = {"prompt": "hello", "max_tokens": 8, "stream": True}
    await s.set_faults(["hang_before_first_byte"])
    with pytest.raises(asyncio.TimeoutError):
        await post(http, s.url + path, body, total_s=0.3)
    await s.set_faults(["health_ok_but_hung"])
    async with http.get(s.url + "/health") as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        await post(http, s.url + path, body, total_s=0.3)
    await s.set_faults(["hang_mid_stream,after=2"])
    got = b""
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(s.url + path, json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
    assert got.count(b"data: ") >= 2 and b"[DONE]" not in got
    await s.set_faults(["crash_mid_stream,after=3"])
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(s.url + path, json=body) as r:
            async for chunk in r.content.iter_any():
                got += chunk
    assert b"[DONE]" not in got
    await s.set_faults(["crash_mid_stream"])
    with pytest.raises(aiohttp.ClientError):
        await post(http, s.url + path, {**body, "stream": False})
    await asyncio.sleep(0.1)
    await s.set_faults([])
    st, _ = await post(http, s.url + path, body)
    assert st == 200
    assert (await s.stats())["in_flight"] == 0


async def test_slow(emu: Factory, http: aiohttp.ClientSession) -> None:
    s = await emu("vllm", "both", faults=["slow:1,factor=11"])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await post(http, s.url + "/v1/completions", {"prompt": "x", "max_tokens": 20})
    assert loop.time() - t0 >= 0.18  # 20 tokens x 10 x 1 ms


async def test_sglang_transfer_faults(emu: Factory, http: aiohttp.ClientSession) -> None:
    (_, _), (ds, dtext), _ = await sgl_pd(emu, http, [], ["transfer_fail"])
    assert ds == 500 and "Decode transfer failed" in dtext
    (_, _), (ds, dtext), _ = await sgl_pd(emu, http, ["transfer_fail"], [])
    assert ds == 500 and "KVTransferError" in dtext
    (_, _), (ds, dtext), _ = await sgl_pd(emu, http, [], ["transfer_stall"], waiting_timeout_s=0.3)
    assert ds == 500 and "timed out after 0.3s" in dtext
    (_ps, _), (ds, dtext), _ = await sgl_pd(emu, http, ["abort_during_transfer"], [])
    obj = json.loads(dtext)
    assert ds == 200 and obj["meta_info"]["finish_reason"]["type"] == "length" and len(obj["output_ids"]) == 1


async def test_sglang_transfer_fail_concurrent(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("sglang", "prefill", time_scale=1.0)
    d = await emu("sglang", "decode", faults=["transfer_fail_concurrent,over=2"], time_scale=1.0)
    body = {"input_ids": [1] + [7] * 3000, "sampling_params": {"max_new_tokens": 1}}

    async def one(room: int) -> int:
        b = {
            **body,
            "input_ids": [1, room] + [7] * 3000,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": room,
        }
        (_, _), (ds, _) = await asyncio.gather(
            post(http, p.url + "/generate", b), post(http, d.url + "/generate", b)
        )
        return ds

    statuses = await asyncio.gather(*(one(r) for r in range(6)))
    assert statuses.count(500) >= 1 and statuses.count(200) >= 2


async def test_vllm_transfer_faults(emu: Factory, http: aiohttp.ClientSession) -> None:
    p = await emu("vllm", "prefill", faults=["transfer_fail"])
    d = await emu("vllm", "decode")
    _, ds, dtext = await handoff(http, p, d, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert ds == 500 and (await d.stats())["kv_transfers_failed"] == 1
    await p.set_faults(["abort_during_transfer"])
    _, ds, dtext = await handoff(http, p, d, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert ds == 200 and json.loads(dtext)["usage"]["completion_tokens"] == 1
    await p.set_faults(["transfer_stall"])
    rid = "stall"
    async with http.post(
        p.url + "/v1/completions",
        json={"prompt": "abc", "max_tokens": 1, "kv_transfer_params": PREFILL_KTP},
        headers={"X-Request-Id": rid},
    ) as r:
        ktp = (await r.json())["kv_transfer_params"]
    with pytest.raises(asyncio.TimeoutError):
        await post(
            http,
            d.url + "/v1/completions",
            {"prompt": "abc", "max_tokens": 3, "kv_transfer_params": ktp},
            total_s=0.4,
        )


async def test_stream_error_event_sglang_decode(emu: Factory, http: aiohttp.ClientSession) -> None:
    body = {**BODY, "stream": True}
    (_, _), (ds, raw), _ = await sgl_pd(emu, http, [], ["transfer_fail"], body=body)
    ev = sse_events(raw)
    assert ds == 200 and json.loads(ev[0])["meta_info"]["finish_reason"]["status_code"] == 500
