"""Plain HTTP helpers for the peer checks: POST a body, read SSE, reduce a response to its tokens."""

from __future__ import annotations

import http.client
import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench import procs
from bench.procs import split_url

TIMEOUT_S = 30.0
MODEL = "peer-model"
SEED = 1234
MAX_TOKENS = 24


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The `data:` payloads of an SSE body, in order (`[DONE]` included)."""
        out = []
        for line in self.body.decode("utf-8").splitlines():
            if line.startswith("data:"):
                out.append(line[5:].strip())
        return out


def request(
    base_url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> Reply:
    host, port, _ = split_url(base_url)
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, data, hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def post(base_url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
    return request(base_url, "POST", path, body, headers)


def get_json(base_url: str, path: str) -> Any:
    r = request(base_url, "GET", path)
    assert r.status == 200, (path, r.status, r.body[:300])
    return r.json()


@dataclass
class Tokens:
    """What a response said, reduced to what must match between P/D and colocated."""

    pieces: list[str]  # text per streamed event (or the one text of a non-streamed reply)
    text: str
    finish_reason: Any
    completion_tokens: int | None
    output_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # meta_info etc.


def tokens_of(path: str, reply: Reply, *, stream: bool, index: int = 0) -> Tokens:
    """Reduce a /generate, /v1/completions or /v1/chat/completions reply (choice `index`)."""
    assert reply.status == 200, (path, reply.status, reply.body[:500])
    if not stream:
        return _tokens_nonstream(path, reply.json(), index)
    events = reply.events()
    assert events, f"no SSE events in {reply.body[:300]!r}"
    assert events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        assert "error" not in c, c
    if path == "/generate":
        chunks = [c for c in chunks if (c.get("index", 0) == index)]
        texts = [c["text"] for c in chunks]
        last = chunks[-1]
        meta = last.get("meta_info", {})
        # SGLang streams the text so far in every event (unless incremental output is on).
        final = texts[-1] if _cumulative(texts) else "".join(texts)
        return Tokens(
            texts,
            final,
            _finish(meta.get("finish_reason")),
            meta.get("completion_tokens"),
            last.get("output_ids"),
        )
    pieces: list[str] = []
    finish = None
    usage_tokens = None
    for c in chunks:
        if c.get("usage"):
            usage_tokens = c["usage"].get("completion_tokens")
        for ch in c.get("choices", []):
            if ch.get("index", 0) != index:
                continue
            if path == "/v1/chat/completions":
                piece = (ch.get("delta") or {}).get("content")
            else:
                piece = ch.get("text")
            if piece:
                pieces.append(piece)
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
    return Tokens(pieces, "".join(pieces), finish, usage_tokens)


def _cumulative(texts: list[str]) -> bool:
    return all(b.startswith(a) for a, b in itertools.pairwise(texts))


def _finish(fr: Any) -> Any:
    if isinstance(fr, dict):
        return fr.get("type")
    return fr


def _tokens_nonstream(path: str, data: Any, index: int) -> Tokens:
    if path == "/generate":
        item = data[index] if isinstance(data, list) else data
        meta = item.get("meta_info", {})
        return Tokens(
            [item["text"]],
            item["text"],
            _finish(meta.get("finish_reason")),
            meta.get("completion_tokens"),
            item.get("output_ids"),
            {"meta_info": meta},
        )
    choice = next(c for c in data["choices"] if c.get("index", 0) == index)
    text = choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]
    usage = data.get("usage") or {}
    return Tokens([text], text, choice.get("finish_reason"), usage.get("completion_tokens"))


@dataclass
class PeerCluster:
    engine: str
    router: procs.ManagedProcess
    router_url: str
    colocated_url: str
    prefill: procs.Upstream
    decode: procs.Upstream

    def kv_counters(self) -> dict[str, int]:
        """Emulator counters summed over the P/D pair (proof that a handoff really happened)."""
        out: dict[str, int] = {}
        for up in (self.prefill, self.decode):
            stats: dict[str, Any] = get_json(up.url, "/emulator/stats")
            for key in ("received", "completed", "kv_transfers_ok", "kv_transfers_failed", "aborted"):
                out[f"{up.role}.{key}"] = int(stats.get(key, 0))
            out["kv_transfers_ok"] = out.get("kv_transfers_ok", 0) + int(stats.get("kv_transfers_ok", 0))
            out["kv_transfers_failed"] = out.get("kv_transfers_failed", 0) + int(
                stats.get("kv_transfers_failed", 0)
            )
        return out

    def logs(self) -> str:
        parts = [
            f"--- {p.name} ---\n{p.log_tail(2000)}"
            for p in (self.router, self.prefill.proc, self.decode.proc)
        ]
        return "\n".join(parts)


def body_for(path: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    if path == "/generate":
        return {
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens},
            "stream": stream,
        }
    if path == "/v1/completions":
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def compare(cluster: PeerCluster, path: str, body: dict[str, Any], *, stream: bool, n: int = 1) -> Tokens:
    before = cluster.kv_counters()
    routed = post(cluster.router_url, path, body)
    assert routed.status == 200, f"router answered {routed.status}: {routed.body[:500]!r}\n{cluster.logs()}"
    direct = post(cluster.colocated_url, path, body)
    after = cluster.kv_counters()
    got = tokens_of(path, routed, stream=stream)
    want = tokens_of(path, direct, stream=stream)
    assert got.text, f"empty output through the router: {routed.body[:500]!r}"
    assert got == want, (
        f"P/D via {cluster.router.name} differs from colocated:\n router: {got}\n direct: {want}"
    )
    assert after["decode.kv_transfers_ok"] - before["decode.kv_transfers_ok"] >= n, (before, after)
    assert after["kv_transfers_failed"] == before["kv_transfers_failed"], (before, after)
    return got


def set_faults(up: procs.Upstream, specs: list[str]) -> None:
    r = post(up.url, "/emulator/faults", specs)
    assert r.status == 200, (r.status, r.body[:300])


def assert_corrupt_kv_changes_tokens(cluster: PeerCluster, path: str, fault: str) -> None:
    """Control: with the prefill shipping bad KV (`fault`), the routed answer must differ.

    Shows that the equality checks above depend on the KV that crossed the wire (a decode
    that recomputed the prompt, or ignored the transfer, would still match).
    """
    body = body_for(path, "a control prompt that is long enough to span several KV blocks " * 2, stream=False)
    want = tokens_of(path, post(cluster.colocated_url, path, body), stream=False)
    set_faults(cluster.prefill, [fault])
    try:
        routed = post(cluster.router_url, path, body)
    finally:
        set_faults(cluster.prefill, [])
    assert routed.status == 200, (routed.status, routed.body[:300])  # silent: no error reaches the client
    got = tokens_of(path, routed, stream=False)
    assert got.text != want.text, f"a corrupt KV transfer ({fault}) gave the colocated answer"


def assert_concurrent_requests_pair(cluster: PeerCluster, n: int = 16) -> None:
    """`n` requests at once through the router: each answer equals the colocated server's (every
    decode got its own prefill's KV, not a neighbour's) and every one crossed a KV transfer."""
    prompts = [f"request number {i}: tell me about {'kv ' * i}" for i in range(n)]
    path = "/v1/completions"

    def one(p: str) -> tuple[Tokens, Tokens]:
        body = body_for(path, p, stream=False, max_tokens=16)
        return (
            tokens_of(path, post(cluster.router_url, path, body), stream=False),
            tokens_of(path, post(cluster.colocated_url, path, body), stream=False),
        )

    before = cluster.kv_counters()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, prompts))
    after = cluster.kv_counters()
    for got, want in results:
        assert got == want
    assert len({g.text for g, _ in results}) > 1, "different prompts gave identical output"
    assert after["decode.kv_transfers_ok"] - before["decode.kv_transfers_ok"] >= n, (before, after)
    assert after["kv_transfers_failed"] == before["kv_transfers_failed"]
