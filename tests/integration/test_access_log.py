"""One `request.done` line per request: those the handlers answer themselves (bad parameters,
content type or coding, wrong method, unknown path or model id, admission refusals) have one like
those the orchestrator serves, at the same level, with no prompt text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from gateway.config import LimitsConfig
from tests.integration.conftest import build_cluster, stop_cluster

SECRET = "do-not-log-this-prompt"


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    rid: str,
    body: dict[str, Any] | bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {"content-type": "application/json", "x-request-id": rid, **(headers or {})}
    async with http.request(method, url, data=data, headers=h) as r:
        return r.status, await r.read()


def completion(max_tokens: int = 4, model: str = "m-colocated", stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": SECRET, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


async def test_every_request_answered_before_the_orchestrator_has_its_access_log_line() -> None:
    c = await build_cluster(
        time_scale=1.0,
        limits=LimitsConfig(
            max_concurrent=1,
            max_queue=1,
            queue_timeout_s=0.3,
            per_client_max_concurrent=1,
            client_key_header="x-client",
            max_tokens_cap=1000,
        ),
    )
    u = c.url
    want: dict[str, tuple[int, str]] = {}  # request id -> (status, outcome)
    try:
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as http:
                # admission: one slot (held by a stream), one queue place
                long = asyncio.ensure_future(
                    call(
                        http,
                        "POST",
                        u + "/v1/completions",
                        "long",
                        completion(150, stream=True),
                        {"x-client": "a"},
                    )
                )
                await asyncio.sleep(0.15)
                st, _ = await call(
                    http, "POST", u + "/v1/completions", "same-client", completion(), {"x-client": "a"}
                )
                assert st == 429
                queued = asyncio.ensure_future(
                    call(http, "POST", u + "/v1/completions", "queued", completion(), {"x-client": "b"})
                )
                await asyncio.sleep(0.05)
                st, _ = await call(
                    http, "POST", u + "/v1/completions", "queue-full", completion(), {"x-client": "c"}
                )
                assert st == 503
                st, _ = await queued
                assert st == 503
                st, _ = await long
                assert st == 200
                want |= {
                    "long": (200, "ok"),
                    "same-client": (429, "too_many_concurrent_requests"),
                    "queued": (503, "queue_timeout"),
                    "queue-full": (503, "overloaded"),
                }
                # the request itself
                cases = [
                    ("bad-json", "POST", "/v1/completions", b'{"prompt": "' + SECRET.encode() + b'"', {}),
                    ("over-cap", "POST", "/v1/completions", completion(5000), {}),
                    (
                        "bad-n",
                        "POST",
                        "/v1/chat/completions",
                        {"model": "m-vllm", "n": 0, "messages": []},
                        {},
                    ),
                    ("text-plain", "POST", "/v1/completions", completion(), {"content-type": "text/plain"}),
                    ("gzip", "POST", "/generate", completion(), {"content-encoding": "gzip"}),
                    ("get-generate", "GET", "/v1/completions", None, {}),
                    ("no-route", "POST", "/v2/nothing", completion(), {}),
                    ("no-model-card", "GET", "/v1/models/nope", None, {}),
                    (
                        "no-model",
                        "POST",
                        "/v1/completions",
                        completion(model="nope"),
                        {},
                    ),  # the orchestrator's
                    ("huge-model", "POST", "/v1/completions", completion(model="m" * 100_000), {}),
                    ("ok", "POST", "/v1/completions", completion(), {}),
                ]
                for rid, method, path, body, headers in cases:
                    st, _ = await call(http, method, u + path, rid, body, headers)
                    want[rid] = (st, "")
        done = [e for e in logs if e["event"] == "request.done"]
        by_id: dict[str, list[dict[str, Any]]] = {}
        for e in done:
            by_id.setdefault(e.get("request_id"), []).append(e)
        for rid, (status, outcome) in want.items():
            lines = by_id.get(rid, [])
            assert len(lines) == 1, (rid, lines)  # one line per request, never two
            e = lines[0]
            assert e["log_level"] == "info" and isinstance(e["duration_ms"], float), e
            if outcome:
                assert e["outcome"] == outcome, e
            if e.get("plan") == "none" and e.get("attempts") == 0:  # answered by the handlers
                assert e["status"] == status and e["outcome"] != "ok", e
        lines = {rid: by_id[rid][0] for rid in want}
        assert lines["bad-json"]["status"] == 400 and lines["bad-json"]["route"] == "completions"
        assert lines["over-cap"]["param"] == "max_tokens" and lines["over-cap"]["status"] == 400
        assert lines["bad-n"]["status"] == 400 and lines["bad-n"]["route"] == "chat"
        assert lines["text-plain"]["status"] == 400
        assert lines["gzip"]["status"] == 415 and lines["gzip"]["outcome"] == "unsupported_media_type"
        assert lines["get-generate"]["status"] == 405 and lines["get-generate"]["route"] == "completions"
        assert lines["no-route"]["status"] == 404 and lines["no-route"]["path"] == "/v2/nothing"
        assert lines["no-model-card"]["outcome"] == "model_not_found"
        assert lines["no-model-card"]["model"] == "nope"
        assert lines["no-model"]["outcome"] == "model_not_found" and lines["no-model"]["plan"] == "none"
        assert len(lines["huge-model"]["model"]) == 200  # a client's name is never logged whole
        for rid in ("same-client", "queued", "queue-full"):
            assert lines[rid]["stage"] == "admission" and lines[rid]["model"] == "m-colocated", lines[rid]
        assert lines["queued"]["duration_ms"] >= 250  # it waited for its slot
        assert lines["ok"]["outcome"] == "ok" and "stage" not in lines["ok"]  # the orchestrator's line
        assert not [e for e in logs if SECRET in repr(e)]  # no prompt text in any log line
    finally:
        await stop_cluster(c)
