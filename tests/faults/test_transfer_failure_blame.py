"""A KV transfer that fails between an SGLang prefill and its decode is the pair's failure, not
the prefill's: real SGLang's prefill then answers a 500 abort naming a KVTransferError
(disaggregation/prefill.py handle_bootstrap_failure / handle_inflight_transfer_failure; its
reason is often "Failed due to an unknown reason from another rank", i.e. the decode's side),
and it usually answers before its decode does. Were that 500 held against the prefill, a broken
decode, or one bad link, would open the breaker of a healthy prefill and take it out of every
other pair."""

from __future__ import annotations

import aiohttp

from adapters import ADAPTERS
from common.request import parse_request
from common.workers import Engine, Role, RouteKind
from emulator.api import EmulatorSpec
from gateway.breaker import BreakerState
from gateway.config import (
    AdminConfig,
    BreakerConfig,
    RetriesConfig,
)
from gateway.registry import Registry, Worker
from tests.faults.sglang_pd import sglang_pd
from tests.integration.test_engine_request_names import _ctx


def test_a_prefill_500_naming_a_kv_transfer_error_is_a_handoff_verdict() -> None:
    req = parse_request(
        RouteKind.COMPLETIONS,
        "/v1/completions",
        b'{"model":"m","prompt":"x"}',
        default_model=None,
        max_n=8,
        max_tokens_cap=None,
    )
    body = (
        b'{"object":"error","message":"Prefill transfer failed for request rank=0 req.rid=\'r\' '
        b"req.bootstrap_room=5 with exception KVTransferError(bootstrap_room=5): Failed due to an "
        b'unknown reason from another rank","type":"InternalServerError","param":null,"code":500}'
    )
    v = ADAPTERS[Engine.SGLANG].judge_prefill(req, _ctx(5, "r"), 500, body)
    assert not v.ok and v.handoff and v.retryable
    other = ADAPTERS[Engine.SGLANG].judge_prefill(req, _ctx(5, "r"), 500, b'{"error":"out of memory"}')
    assert not other.ok and not other.handoff  # any other 5xx is still the prefill's own


async def test_failed_transfers_open_the_pair_breaker_not_the_prefill_s() -> None:
    prefill = EmulatorSpec(engine="sglang", role="prefill", model="m", faults=["transfer_fail"])
    async with sglang_pd(
        [prefill],
        retries=RetriesConfig(max_attempts=1),
        breaker=BreakerConfig(failure_threshold=2, success_threshold=1, open_s=60.0),
        admin=AdminConfig(token="t0ken"),
    ) as c:
        gw = c.gateway
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(
                    gw.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}
                ) as r:
                    await r.read()
                    assert r.status >= 500
                    if gw.registry.pair_breaker("p", "d").state is BreakerState.OPEN:
                        break
        assert gw.registry.get("p").breaker.state is BreakerState.CLOSED
        assert gw.registry.get("d").breaker.state is BreakerState.CLOSED
        assert gw.registry.pair_breaker("p", "d").state is BreakerState.OPEN
        # the open pair is visible: both workers are usable on their own, but the model has no
        # route, so /readiness says 503 and /v1/models lists no route (a probe found them at
        # 200 with every worker "usable" while each request got 503), /admin/pairs names the
        # pair and /metrics has its gauge
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/readiness") as r:
                assert r.status == 503
                assert await r.json() == {"ready": False, "models": {"m": []}}
            async with s.get(gw.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["routes"] == []
            auth = {"authorization": "Bearer t0ken"}
            async with s.get(gw.url + "/admin/workers", headers=auth) as r:
                assert all(w["usable"] for w in (await r.json())["workers"])
            async with s.get(gw.url + "/admin/pairs", headers=auth) as r:
                assert await r.json() == {
                    "pairs": [{"prefill": "p", "decode": "d", "breaker": "open", "usable": False}]
                }
            async with s.get(gw.url + "/metrics") as r:
                assert 'pdgw_pair_breaker_open{decode="d",prefill="p"} 1.0' in await r.text()


async def test_a_decode_whose_handoffs_fail_with_every_prefill_opens_its_own_breaker() -> None:
    """A decode answering every handoff with a 5xx is no pair's problem but its own: once its
    handoffs have failed with two different prefills (and gone well with none since), each failure
    counts against its own breaker, which takes it out of every pair at once. Before, each pair
    had to fail failure_threshold times on its own (N prefills x threshold failed requests), and
    the decode stayed "usable"."""
    async with sglang_pd(
        2,
        EmulatorSpec(engine="sglang", role="decode", model="m", faults=["http_error"]),
        retries=RetriesConfig(max_attempts=1),
        breaker=BreakerConfig(failure_threshold=2, success_threshold=1, open_s=60.0),
    ) as c:
        reg = c.gateway.registry
        async with aiohttp.ClientSession() as s:
            for _ in range(8):
                async with s.post(
                    c.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}
                ) as r:
                    await r.read()
                    assert r.status >= 500
                if reg.get("d").breaker.state is BreakerState.OPEN:
                    break
        assert reg.get("d").breaker.state is BreakerState.OPEN
        assert reg.get("p1").breaker.state is BreakerState.CLOSED
        assert reg.get("p2").breaker.state is BreakerState.CLOSED


def test_failures_with_one_partner_stay_the_pair_s_and_a_good_handoff_clears_them() -> None:
    # (the decode alone in its pool may be ejected for any failure here: blame is under test)
    reg = Registry(
        BreakerConfig(failure_threshold=1, success_threshold=1, open_s=60.0, max_ejected_share=1.0)
    )
    p1, p2, p3, d = (
        Worker(i, f"http://127.0.0.1:{n}", r, Engine.SGLANG)
        for i, n, r in (
            ("p1", 1, Role.PREFILL),
            ("p2", 2, Role.PREFILL),
            ("p3", 4, Role.PREFILL),
            ("d", 3, Role.DECODE),
        )
    )
    for w in (p1, p2, p3, d):
        reg.add(w)

    def fail(p: Worker, request: str, suspects: tuple[Worker, ...] | None = None) -> None:
        both = (p, d) if suspects is None else suspects
        reg.record_pair(p, d, reg.pair_breaker(p.id, "d"), False, suspects=both, request=request)

    fail(p1, "r1")
    assert d.breaker.state is BreakerState.CLOSED  # one partner: the pair's failure only
    reg.record_pair(p2, d, reg.pair_breaker("p2", "d"), True)  # a good handoff: d is fine
    fail(p2, "r2")
    assert d.breaker.state is BreakerState.CLOSED and d.failed_partners == {"p2": "r2"}
    fail(p1, "r3", suspects=())  # no worker's failure (blamed on one already, or the request's)
    assert d.breaker.state is BreakerState.CLOSED
    fail(p1, "r2")  # the same request retried on another pair: still one request
    assert d.breaker.state is BreakerState.CLOSED
    fail(p3, "r4")  # three partners, two requests, nothing good between
    assert d.breaker.state is BreakerState.OPEN
    assert all(p.breaker.state is BreakerState.CLOSED for p in (p1, p2, p3))


async def test_a_request_that_every_prefill_refuses_does_not_blame_its_decode() -> None:
    """SGLang's prefill refusing what its decode took (a prompt past the prefill's own limit) is
    provoked by the request: the gateway's retry of it on a second prefill must not make the
    healthy decode "broken with two partners" (found by a review of record_pair)."""
    truncating = EmulatorSpec(engine="sglang", role="prefill", model="m", faults=["silent_truncation"])
    async with sglang_pd(
        [truncating, truncating],
        retries=RetriesConfig(max_attempts=3),
        breaker=BreakerConfig(failure_threshold=2, success_threshold=1, open_s=60.0),
    ) as c:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # (then both pairs are open: theirs to count)
                async with s.post(
                    c.url + "/v1/completions",
                    json={"model": "m", "prompt": "hello there friend", "max_tokens": 4},
                ) as r:
                    await r.read()
                    assert r.status == 400
        assert c.gateway.registry.get("d").breaker.state is BreakerState.CLOSED
