"""Kubernetes discovery against a fake API server on loopback that speaks the real list + watch
protocol (tests/integration/fake_kube.py), with emulated engines as the pods: pods added, made
unready and ready again, deleted (gracefully, with a request in flight), watches that expire
(re-watched from the last version or bookmark, no relist) and a 410 Gone (relist)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from gateway.app import Gateway
from gateway.config import GatewayConfig, HealthConfig, KubernetesConfig, ListenConfig
from gateway.discovery.kubernetes import KubernetesDiscovery, pod_worker
from policies.snapshot import Engine, Role
from tests.integration.fake_kube import FakeKubeAPI

NS = "ml"
PREFILL = {"app": "engine", "role": "prefill"}
DECODE = {"app": "engine", "role": "decode"}
COLOCATED = {"app": "engine", "role": "colocated"}


async def until(cond: Callable[[], bool], what: str = "condition", within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class Setup:
    api: FakeKubeAPI
    gw: Gateway
    emus: dict[str, EmulatorHandle]

    @property
    def discovery(self) -> KubernetesDiscovery:
        assert self.gw.discovery is not None
        return self.gw.discovery

    def ids(self) -> set[str]:
        return {w.id for w in self.gw.registry.workers()}

    def add(self, name: str, labels: dict[str, str], emu: EmulatorHandle, **kw: Any) -> None:
        notes = {"pd-gateway/port": str(emu.port)}
        if emu.bootstrap_port is not None:
            notes["sglang.ai/bootstrap-port"] = str(emu.bootstrap_port)
        self.api.add_pod(NS, name, labels=labels, annotations=notes, **kw)


async def complete(gw: Gateway, model: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4} | extra
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    api = FakeKubeAPI()
    await api.start()
    emus = {
        "p0": await start_emulator(
            EmulatorSpec(engine="sglang", role="prefill", model="m", bootstrap_port=0)
        ),
        "d0": await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m", time_scale=1.0)),
        "d1": await start_emulator(EmulatorSpec(engine="sglang", role="decode", model="m")),
        "c0": await start_emulator(EmulatorSpec(engine="vllm", role="both", model="m-vllm")),
    }
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0),
        health=HealthConfig(interval_s=3600.0, timeout_s=2.0),
        kubernetes=KubernetesConfig(
            namespace=NS,
            prefill_selector="app=engine,role=prefill",
            decode_selector="app=engine,role=decode",
            colocated_selector="app=engine,role=colocated",
            api_url=api.url,
            retry_s=0.05,
            drain_timeout_s=20.0,
        ),
    )
    s = Setup(api, Gateway(cfg), emus)
    s.add("prefill-0", PREFILL, emus["p0"])
    s.add("decode-0", DECODE, emus["d0"])
    try:
        await s.gw.start()
        yield s
    finally:
        await s.gw.stop(grace_s=1.0)
        await api.stop()
        for e in emus.values():
            await e.stop()


def test_pod_to_worker() -> None:
    cfg = KubernetesConfig(prefill_selector="a=b", port=30000)
    pod: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": {"pd-gateway/engine": "sglang", "pd-gateway/model": "llama"},
            "annotations": {"sglang.ai/bootstrap-port": "9001"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    wc = pod_worker(pod, Role.PREFILL, cfg)
    assert wc is not None
    assert (wc.worker_id, wc.url, wc.engine, wc.model, wc.bootstrap_port) == (
        "ns/p",
        "http://10.1.2.3:30000",
        Engine.SGLANG,
        "llama",
        9001,
    )
    # no annotation: SGLang's default bootstrap port; a vLLM pod has none; IPv6 in brackets
    pod["metadata"]["annotations"] = {}
    assert pod_worker(pod, Role.PREFILL, cfg).bootstrap_port == 8998  # type: ignore[union-attr]
    pod["metadata"]["labels"]["pd-gateway/engine"] = "vllm"
    pod["status"]["podIP"] = "fd00::7"
    wc = pod_worker(pod, Role.PREFILL, cfg)
    assert wc is not None and (wc.bootstrap_port, wc.url) == (None, "http://[fd00::7]:30000")
    # not a worker while not ready, terminating or without an IP
    for change in (
        lambda p: p["status"].update(conditions=[{"type": "Ready", "status": "False"}]),
        lambda p: p["metadata"].update(deletionTimestamp="2026-01-01T00:00:00Z"),
        lambda p: p["status"].update(phase="Pending"),
        lambda p: p["status"].pop("podIP"),
    ):
        copy = json.loads(json.dumps(pod))
        change(copy)
        assert pod_worker(copy, Role.PREFILL, cfg) is None


async def test_pods_ready_at_start_are_workers_before_it_listens(setup: Setup) -> None:
    s = setup
    assert s.ids() == {"ml/prefill-0", "ml/decode-0"}
    p = s.gw.registry.get("ml/prefill-0")
    assert (p.role, p.engine, p.bootstrap_port, p.healthy) == (
        Role.PREFILL,
        Engine.SGLANG,
        s.emus["p0"].bootstrap_port,
        True,
    )
    status, out = await complete(s.gw, "m")
    assert status == 200, out
    assert s.api.lists == [
        (NS, "app=engine,role=prefill"),
        (NS, "app=engine,role=decode"),
        (NS, "app=engine,role=colocated"),
    ]
    await until(lambda: s.api.open_watches == 3, what="three watches")
    # each watch starts from its list's version, with bookmarks and a server-side timeout
    assert all(c.resource_version is not None and c.bookmarks and c.timeout_s for c in s.api.watch_calls)


async def test_pod_added_by_watch_with_engine_from_its_label(setup: Setup) -> None:
    s = setup
    await until(lambda: s.api.open_watches == 3, what="watches")
    status, _ = await complete(s.gw, "m-vllm")
    assert status == 404
    s.add("colocated-0", COLOCATED | {"pd-gateway/engine": "vllm"}, s.emus["c0"])
    await until(lambda: "ml/colocated-0" in s.ids(), what="the colocated pod's worker")
    assert s.gw.registry.get("ml/colocated-0").engine is Engine.VLLM
    status, out = await complete(s.gw, "m-vllm")
    assert status == 200, out


async def _stream(gw: Gateway, tokens: int) -> tuple[int, list[str]]:
    body = {"model": "m", "prompt": "a long answer", "max_tokens": tokens, "stream": True, "ignore_eos": True}
    events: list[str] = []
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as r:
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data: "):
                events.append(text[6:])
        return r.status, events


async def test_unready_pod_is_drained_without_dropping_its_stream_and_comes_back(setup: Setup) -> None:
    s = setup
    await until(lambda: s.api.open_watches == 3, what="watches")
    decode = s.gw.registry.get("ml/decode-0")
    stream = asyncio.create_task(_stream(s.gw, 60))  # ~60 decode steps at time scale 1
    await until(lambda: decode.inflight == 1, what="the stream on the decode")
    s.api.set_ready(NS, "decode-0", False)
    await until(lambda: decode.draining, what="the drain")
    # no new request goes to it: this model has no other decode now
    status, out = await complete(s.gw, "m")
    assert status == 503, out
    assert "ml/decode-0" in s.ids() and not stream.done()  # still serving its stream
    status, events = await stream
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    usage = [json.loads(e) for e in events[:-1]]
    assert text and not any("error" in u for u in usage), events[-3:]
    await until(lambda: "ml/decode-0" not in s.ids(), what="the removal")
    # ready again: back in, serving
    s.api.set_ready(NS, "decode-0", True)
    await until(lambda: "ml/decode-0" in s.ids(), what="the worker back")
    status, out = await complete(s.gw, "m")
    assert status == 200, out


async def test_deleted_pod_finishes_its_request_then_goes(setup: Setup) -> None:
    s = setup
    await until(lambda: s.api.open_watches == 3, what="watches")
    s.add("decode-1", DECODE, s.emus["d1"])
    await until(lambda: "ml/decode-1" in s.ids(), what="the second decode")
    decode0 = s.gw.registry.get("ml/decode-0")
    stream = asyncio.create_task(_stream(s.gw, 40))
    await until(
        lambda: decode0.inflight == 1 or s.gw.registry.get("ml/decode-1").inflight == 1, what="the stream"
    )
    on = "decode-0" if decode0.inflight == 1 else "decode-1"
    other = "ml/decode-1" if on == "decode-0" else "ml/decode-0"
    s.api.delete_pod(NS, on)  # graceful: a deletionTimestamp first
    await until(lambda: s.gw.registry.get(f"ml/{on}").draining, what="the drain")
    for _ in range(3):  # new requests go to the other decode meanwhile
        status, out = await complete(s.gw, "m")
        assert status == 200, out
    assert s.gw.registry.get(other).breaker.state.value == "closed"
    status, events = await stream
    assert status == 200 and events[-1] == "[DONE]"
    s.api.finish_delete(NS, on)
    await until(lambda: f"ml/{on}" not in s.ids(), what="the removal")
    assert s.ids() == {"ml/prefill-0", other}


async def test_watch_expiry_rewatches_from_the_last_bookmark_without_a_relist(setup: Setup) -> None:
    s = setup
    await until(lambda: s.api.open_watches == 3, what="watches")
    lists, watches = len(s.api.lists), len(s.api.watch_calls)
    version = s.api.bookmark()
    await asyncio.sleep(0.1)  # the bookmark is read
    s.api.expire_watches()
    await until(lambda: len(s.api.watch_calls) == watches + 3, what="the re-watches")
    assert len(s.api.lists) == lists  # no relist
    assert [c.resource_version for c in s.api.watch_calls[watches:]] == [version] * 3
    # events after the expiry are still seen
    s.add("decode-1", DECODE, s.emus["d1"])
    await until(lambda: "ml/decode-1" in s.ids(), what="a pod added after the expiry")
    assert s.discovery.relists == 0


async def test_410_gone_relists_and_catches_up_with_what_was_missed(setup: Setup) -> None:
    s = setup
    await until(lambda: s.api.open_watches == 3, what="watches")
    lists = len(s.api.lists)
    s.api.offline = True  # cut off: every request a 503 ...
    s.api.expire_watches()
    await asyncio.sleep(0.2)
    s.api.delete_pod(NS, "decode-0", graceful=False)  # ... while pods change ...
    s.add("decode-1", DECODE, s.emus["d1"])
    s.api.compact()  # ... and the history of those changes is compacted away
    s.api.offline = False
    await until(lambda: s.discovery.relists == 3, what="a relist per role after 410 Gone")
    await until(lambda: s.ids() == {"ml/prefill-0", "ml/decode-1"}, what="the missed changes")
    # a role's relist is counted when its 410 arrives and lists after: the roles whose pods did
    # not change may still be listing when the changed ones are already seen
    await until(lambda: len(s.api.lists) >= lists + 3, what="one list per role after 410 Gone")
    assert len(s.api.lists) == lists + 3
    status, out = await complete(s.gw, "m")
    assert status == 200, out


async def test_outside_a_cluster_without_api_url_is_a_clear_start_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.config import ConfigError

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = GatewayConfig(
        listen=ListenConfig(host="127.0.0.1", port=0), kubernetes=KubernetesConfig(decode_selector="a=b")
    )
    gw = Gateway(cfg)
    try:
        with pytest.raises(
            ConfigError, match="kubernetes: cannot reach the API with the pod's service account"
        ):
            await gw.start()
    finally:
        await gw.stop(grace_s=0.1)
