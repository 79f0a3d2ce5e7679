"""Queries of death (issue #27, item 2), against real emulator servers: an SGLang engine dies of a
prompt id outside its vocabulary (as SGLang 0.5.23 does: the emulator's scheduler exits and the
server stops listening).

With the default configuration (no `vocab_size`, `max_attempts` 3) one such request took down
three engines of three. Now token ids above every id the model has been seen to serve are
*unproven* (gateway/orchestration/token_bounds.py): sent one at a time to one colocated engine,
not tried again if it dies, and refused for a while after such a death; the issue's test (ten
out-of-vocabulary requests in every spelling: one engine lost at most) is the second half here.

Any other request an engine dies of (here: ids under a `vocab_size` configured too large, which
the bounds trust) gets one more try at most, and a copy of it is refused without reaching any
engine (quarantine.py). A connection an engine breaks while it stays up is no query of death:
the request is served by its retry and nothing is quarantined."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from emulator.tokenizer import VOCAB_SIZE
from gateway.app import Gateway
from gateway.config import GatewayConfig, ListenConfig, WorkerConfig
from policies.snapshot import Engine, Role
from tests.integration.conftest import build_cluster, stop_cluster
from tests.integration.test_vocabulary import BIG, CHAT, CMPL, GEN, MSG, REFUSED, with_budget

POISON = {"model": "m", "text": "hi", "input_ids": [5, 1_000_000], "sampling_params": {"max_new_tokens": 2}}
VALID = {"model": "m", "text": "hello", "sampling_params": {"max_new_tokens": 2}}


# a vocabulary size configured larger than the model's (259): ids below it pass the gateway's
# check, and the learned bounds do not apply (the operator's figure is trusted)
TOO_LARGE = 2_000_000


async def colocated(
    n: int, faults: list[str] | None = None, time_scale: float = 0.0, vocab_size: int | None = None
) -> tuple[dict[str, EmulatorHandle], Gateway]:
    emus = {
        f"c{i}": await start_emulator(
            EmulatorSpec(
                engine="sglang",
                role="both",
                model="m",
                faults=(faults or []) if i == 0 else [],
                time_scale=time_scale,
            )
        )
        for i in range(n)
    }
    workers = tuple(
        WorkerConfig(url=e.url, role=Role.COLOCATED, engine=Engine.SGLANG, id=name, vocab_size=vocab_size)
        for name, e in emus.items()
    )
    gw = Gateway(GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=0), workers=workers))
    await gw.start()
    return emus, gw


async def stop(emus: dict[str, EmulatorHandle], gw: Gateway) -> None:
    await gw.stop()
    for e in emus.values():
        await e.stop()


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        return r.status, json.loads(await r.read()), r.headers


def metric(gw: Gateway, event: str) -> float:
    line = f'pdgw_query_of_death_total{{event="{event}"}} '
    for x in gw.metrics.render().decode().splitlines():
        if x.startswith(line):
            return float(x.split()[-1])
    return 0.0


async def received(emus: dict[str, EmulatorHandle]) -> int:
    return sum([(await e.stats())["received"] for e in emus.values() if not e.dead])


async def test_one_poison_request_takes_down_two_engines_at_most_and_its_copy_none() -> None:
    emus, gw = await colocated(3, vocab_size=TOO_LARGE)
    try:
        status, out, _ = await post(gw.url, POISON)
        dead = [n for n, e in emus.items() if e.dead]
        assert len(dead) <= 2, dead  # it was 3 of 3 (a try and two retries)
        assert status == 502 and out["error"]["code"] == "engine_dropped_request", out
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert metric(gw, "engine_died") == len(dead) and metric(gw, "not_retried") == 1
        assert metric(gw, "quarantined") == 1

        before = await received(emus)
        status, out, headers = await post(gw.url, POISON)  # the same request again
        assert status == 503 and out["error"]["code"] == "request_quarantined", out
        assert "engines died" in out["error"]["message"] and int(headers["Retry-After"]) > 0
        assert [n for n, e in emus.items() if e.dead] == dead  # no engine more lost
        assert await received(emus) == before  # it reached none
        assert metric(gw, "refused") == 1

        status, out, _ = await post(gw.url, VALID)  # other requests are served
        assert status == 200, out
    finally:
        await stop(emus, gw)


async def test_on_a_pd_pair_the_poison_takes_down_the_pair_and_nothing_more() -> None:
    """An SGLang P/D attempt sends the request to both legs, and both die of it: that is its two
    engines; the colocated worker behind them (the fallback ladder's next rung) is spared, and
    a copy reaches no engine."""
    c = await build_cluster(colocated_fallback=True, vocab_size=TOO_LARGE)
    try:
        body = {**POISON, "model": "m-sglang"}
        status, out, _ = await post(c.url, body)
        assert status == 502 and out["error"]["code"] == "engine_dropped_request", out
        assert sorted(n for n, e in c.emulators.items() if e.dead) == ["sgl-d", "sgl-p"]
        status, out, _ = await post(c.url, body)
        assert status == 503 and out["error"]["code"] == "request_quarantined", out
        assert (await c.emulators["sgl-c"].stats())["received"] == 0
        status, out, _ = await post(c.url, {**VALID, "model": "m-sglang"})  # served colocated
        assert status == 200, out
    finally:
        await stop_cluster(c)


async def test_one_engine_dying_under_its_requests_quarantines_none_of_them() -> None:
    """An engine that crashes or is stopped fails every request it holds: each is served by its
    one more try, and a copy of it later is served too (one death is no query of death)."""
    emus, gw = await colocated(2, time_scale=1.0)
    try:
        slow = {**VALID, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        first = asyncio.ensure_future(post(gw.url, slow))
        victim = ""
        for _ in range(500):  # until an engine holds it
            busy = [n for n, e in emus.items() if (await e.stats())["in_flight"]]
            if busy:
                victim = busy[0]
                break
            await asyncio.sleep(0.01)
        await emus[victim].stop()  # the engine goes away holding the request
        status, out, _ = await first
        assert status == 200, out  # its one more try, on the other engine
        assert metric(gw, "engine_died") == 1 and metric(gw, "quarantined") == 0
        status, out, _ = await post(gw.url, slow)  # a copy: served, not refused
        assert status == 200, out
        assert metric(gw, "refused") == 0
    finally:
        await stop(emus, gw)


async def test_a_connection_broken_by_an_engine_that_stays_up_quarantines_nothing() -> None:
    # c0 breaks every connection it is sent (and stays up); the same request is tried elsewhere
    emus, gw = await colocated(2, faults=["crash_mid_stream,after=0"])
    try:
        for _ in range(4):
            status, out, _ = await post(gw.url, VALID)
            assert status == 200, out
        assert not [n for n, e in emus.items() if e.dead]
        assert metric(gw, "engine_died") == 0 and metric(gw, "refused") == 0
    finally:
        await stop(emus, gw)


# -- the "query of death" test: the default configuration (no vocab_size), three SGLang
# colocated workers and an SGLang P/D pair of one model, out-of-vocabulary requests in every
# spelling a body can carry token ids in (tests/integration/test_vocabulary.py's REFUSED)


async def colocated_and_pair(
    time_scale: float = 0.0, **cfg: Any
) -> tuple[dict[str, EmulatorHandle], Gateway]:
    t = time_scale
    specs = {
        **{f"c{i}": EmulatorSpec(engine="sglang", role="both", model="m", time_scale=t) for i in range(3)},
        "p": EmulatorSpec(engine="sglang", role="prefill", model="m", bootstrap_port=0, time_scale=t),
        "d": EmulatorSpec(engine="sglang", role="decode", model="m", time_scale=t),
    }
    emus = {name: await start_emulator(spec) for name, spec in specs.items()}
    roles = {"both": Role.COLOCATED, "prefill": Role.PREFILL, "decode": Role.DECODE}
    workers = tuple(
        WorkerConfig(
            url=emus[name].url,
            role=roles[spec.role],
            engine=Engine.SGLANG,
            id=name,
            bootstrap_port=emus[name].bootstrap_port if spec.role == "prefill" else None,
        )
        for name, spec in specs.items()
    )
    gw = Gateway(GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=0), workers=workers, **cfg))
    await gw.start()
    return emus, gw


async def call(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if raw else {}


def spelled(path: str, body: dict[str, Any], oov: int) -> dict[str, Any]:
    """A REFUSED body with its out-of-vocabulary id (BIG, in whatever spelling) made `oov`."""
    text = json.dumps(with_budget(path, {"model": "m", **body}))  # (1e6 is written 1000000.0)
    return dict(json.loads(text.replace(str(BIG), str(oov))))


# valid requests: a text on each route, and token ids the gateway has seen served (up to 200)
VALID_AFTER: list[tuple[str, dict[str, Any]]] = [
    (GEN, {"model": "m", "text": "hello", "sampling_params": {"max_new_tokens": 2}}),
    (CMPL, {"model": "m", "prompt": "hello", "max_tokens": 2}),
    (CHAT, {"model": "m", "messages": MSG, "max_tokens": 2}),
    (GEN, {"model": "m", "input_ids": [5, 200, 7], "sampling_params": {"max_new_tokens": 2}}),
    (CMPL, {"model": "m", "prompt": [[5, 6], [200]], "max_tokens": 2}),
    (CHAT, {"model": "m", "messages": MSG, "input_ids": [5, 200], "max_tokens": 2}),
]


async def served_traffic(url: str) -> None:
    """What a gateway in service has seen: prompts of token ids up to 200, served."""
    for path, body in VALID_AFTER:
        status, out = await call(url, path, body)
        assert status == 200, out


async def ten_of_each(url: str, ids: list[int]) -> list[tuple[int, dict[str, Any]]]:
    """Ten requests in every spelling (`ids[k]` in the k-th round), each round's spellings at once."""
    got: list[tuple[int, dict[str, Any]]] = []
    for oov in ids:
        got += await asyncio.gather(*(call(url, path, spelled(path, body, oov)) for path, body, _ in REFUSED))
    return got


def clear_refusals(got: list[tuple[int, dict[str, Any]]]) -> None:
    for status, out in got:
        assert status == 400, out
        err = out["error"]
        assert set(err) == {"message", "type", "param", "code"}, out
        assert err["code"] == "unproven_token_ids" and err["type"] == "invalid_request_error", out
        assert err["param"] in ("input_ids", "prompt", "stop_token_ids"), out
        assert "vocab_size" in err["message"] and "127.0.0.1" not in err["message"], out


@pytest.mark.parametrize(
    "ids",
    [
        [BIG] * 10,  # the same id
        [BIG - 7 * k for k in range(10)],  # ids coming down: each below the last that killed
        [VOCAB_SIZE + k for k in range(10)],  # just past the vocabulary, going up
    ],
    ids=["same", "descending", "just_past"],
)
async def test_ten_out_of_vocabulary_requests_in_every_spelling_cost_one_engine_at_most(
    ids: list[int],
) -> None:
    emus, gw = await colocated_and_pair()
    try:
        await served_traffic(gw.url)
        got = await ten_of_each(gw.url, ids)
        assert len(got) == 10 * len(REFUSED)
        dead = [n for n, e in emus.items() if e.dead]
        assert len(dead) <= 1 and "p" not in dead and "d" not in dead, dead  # one colocated at most
        clear_refusals(got)  # every client: a 400 that says why, in OpenAI's shape
        assert metric(gw, "unproven_killed") == len(dead)
        assert metric(gw, "unproven_refused") >= len(got) - 1
        for _ in range(3):  # later valid requests: all served, by the engines left
            for path, body in VALID_AFTER:
                status, out = await call(gw.url, path, body)
                assert status == 200, (path, body, out)
        assert [n for n, e in emus.items() if e.dead] == dead
    finally:
        await stop(emus, gw)


async def test_an_unproven_valid_id_is_served_alone_and_proves_its_ids() -> None:
    """Token ids above every id served so far go one request at a time, to one colocated engine
    (never a P/D pair): served, they are proven, and later requests with them pass as usual."""
    emus, gw = await colocated_and_pair(time_scale=1.0)
    try:
        body = {"model": "m", "input_ids": [5, 250], "sampling_params": {"max_new_tokens": 20}}
        for _ in range(3):
            status, out = await call(gw.url, GEN, body)
            assert status == 200, out
            assert gw.orchestrator.bounds.low("m") == 250
        # the first went to a colocated engine; the others, proven, wherever the policy chose
        assert sum([(await emus[f"c{i}"].stats())["received"] for i in range(3)]) >= 1
        assert (await emus["p"].stats())["received"] <= 2
        body = {**body, "input_ids": [5, VOCAB_SIZE - 1]}
        got = await asyncio.gather(*(call(gw.url, GEN, body) for _ in range(6)))
        assert all(status == 200 for status, _ in got), got
        assert gw.orchestrator.bounds.low("m") == VOCAB_SIZE - 1
        assert metric(gw, "unproven_waited") >= 1  # the others waited for the first one's outcome
        assert not [n for n, e in emus.items() if e.dead]
    finally:
        await stop(emus, gw)


async def test_probe_after_death_tries_ids_below_the_one_that_killed() -> None:
    """`retries.unproven_after_death = "probe"`: after a death, only ids at or above the one that
    killed are refused; an unproven id below it is tried (here: out of vocabulary too, so it
    takes another engine: the price of the choice, docs/guards.md)."""
    from gateway.config import RetriesConfig

    emus, gw = await colocated_and_pair(retries=RetriesConfig(unproven_after_death="probe"))
    try:
        oov = {"model": "m", "input_ids": [5, BIG], "sampling_params": {"max_new_tokens": 2}}
        assert (await call(gw.url, GEN, oov))[0] == 400
        assert len([n for n, e in emus.items() if e.dead]) == 1
        status, out = await call(gw.url, GEN, {**oov, "input_ids": [5, BIG + 1]})  # refused unsent
        assert status == 400 and "at or above" in out["error"]["message"], out
        assert len([n for n, e in emus.items() if e.dead]) == 1
        status, out = await call(gw.url, GEN, {**oov, "input_ids": [5, 300]})  # tried
        assert status == 400 and "died while holding it" in out["error"]["message"], out
        assert len([n for n, e in emus.items() if e.dead]) == 2
    finally:
        await stop(emus, gw)


async def test_after_a_death_unproven_ids_are_refused_until_an_operator_resets_the_bounds() -> None:
    """The price of the default (`"refuse"`): a valid id above every id served so far is refused
    too while a death is remembered; the admin API shows why and forgets the death on request."""
    from gateway.config import AdminConfig

    emus, gw = await colocated_and_pair(admin=AdminConfig(token="t"))
    auth = {"authorization": "Bearer t"}
    try:
        await served_traffic(gw.url)  # ids up to 200
        oov = {"model": "m", "input_ids": [5, BIG], "sampling_params": {"max_new_tokens": 2}}
        assert (await call(gw.url, GEN, oov))[0] == 400
        valid = {**oov, "input_ids": [5, 250]}  # inside the vocabulary (259), but unproven
        status, out = await call(gw.url, GEN, valid)
        assert status == 400 and "above every id this model has been seen to serve" in out["error"]["message"]
        async with aiohttp.ClientSession(headers=auth) as s:
            async with s.get(gw.url + "/admin/token_bounds") as r:
                state = (await r.json())["models"]
            assert state == [
                {
                    "model": "m",
                    "proven_up_to": 200,
                    "unproven_in_flight": False,
                    "killed_by": BIG,
                    "refusing_s": state[0]["refusing_s"],
                }
            ]
            assert state[0]["refusing_s"] > 290
            async with s.post(gw.url + "/admin/token_bounds/reset?model=m") as r:
                assert r.status == 200 and (await r.json())["reset"] == 1
        status, out = await call(gw.url, GEN, valid)  # tried again, alone: served and proven
        assert status == 200, out
        assert gw.orchestrator.bounds.low("m") == 250
        assert len([n for n, e in emus.items() if e.dead]) == 1
    finally:
        await stop(emus, gw)
