"""A fake Kubernetes API server on loopback that speaks the real list + watch protocol for pods.

What it does as the real API server does (k8s.io/apiserver, "Efficient detection of changes"):
- `GET /api/v1/namespaces/{ns}/pods` and `GET /api/v1/pods` list the pods a `labelSelector`
  matches, with the list's `metadata.resourceVersion`;
- the same with `watch=true` streams one JSON event per line (`ADDED`, `MODIFIED`, `DELETED`)
  with every change after `resourceVersion` (none given: the current pods as ADDED first), sends
  `BOOKMARK` events (only the version) when asked and `allowWatchBookmarks` is set, and ends the
  stream after `timeoutSeconds`;
- a watch from a version older than the compacted history gets an `ERROR` event whose object is
  a `Status` with `code: 410`, `reason: Expired`, as etcd compaction causes;
- a graceful delete is a MODIFIED event with `deletionTimestamp`, then DELETED.

Tests drive it: add pods, flip readiness, delete, end open watches, compact history, and cut it
off (every request a 503) for a while.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class WatchCall:
    namespace: str | None
    selector: str
    resource_version: str | None
    bookmarks: bool
    timeout_s: float | None


@dataclass(eq=False)
class _Watcher:
    namespace: str | None
    selector: str
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based selectors: `a=b`, `a==b`, `a!=b`, `a` (exists), `!a` (absent), comma-joined."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKubeAPI:
    def __init__(self) -> None:
        self._rv = itertools.count(1000)
        self.version = next(self._rv)
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, pod)
        self.compacted = 0  # versions up to this are gone from history
        self.lists: list[tuple[str | None, str]] = []
        self.watch_calls: list[WatchCall] = []
        self.offline = False
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- server ----------------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self.expire_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if self.offline:
            return web.json_response(_status(503, "ServiceUnavailable", "offline"), status=503)
        ns = request.match_info.get("ns")
        q = request.query
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("true", "1", "True"):
            timeout = q.get("timeoutSeconds")
            call = WatchCall(
                ns,
                selector,
                q.get("resourceVersion"),
                q.get("allowWatchBookmarks") in ("true", "True", "1"),
                float(timeout) if timeout else None,
            )
            self.watch_calls.append(call)
            return await self._watch(request, call)
        self.lists.append((ns, selector))
        items = [p for p in self.pods.values() if self._selected(p, ns, selector)]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    def _selected(self, pod: dict[str, Any], ns: str | None, selector: str) -> bool:
        meta = pod["metadata"]
        return (ns is None or meta["namespace"] == ns) and selector_matches(selector, meta.get("labels", {}))

    async def _watch(self, request: web.Request, call: WatchCall) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        w = _Watcher(call.namespace, call.selector, call.bookmarks)
        if call.resource_version in (None, "", "0"):
            backlog = [("ADDED", p) for p in self.pods.values()]
        else:
            since = int(call.resource_version)
            if since < self.compacted:
                err = _status(410, "Expired", f"too old resource version: {since} ({self.compacted})")
                await resp.write(json.dumps({"type": "ERROR", "object": err}).encode() + b"\n")
                return resp
            backlog = [(t, p) for v, t, p in self.history if v > since]
        self._watchers.add(w)  # with the backlog taken in the same step: no change falls between
        try:
            for kind, pod in backlog:
                if self._selected(pod, w.namespace, w.selector):
                    await resp.write(_line(kind, pod))
            async with asyncio.timeout(call.timeout_s):
                while True:
                    event = await w.queue.get()
                    if event is None:
                        break
                    await resp.write(json.dumps(event).encode() + b"\n")
        except TimeoutError:
            pass
        finally:
            self._watchers.discard(w)
        return resp

    # -- what the tests do -------------------------------------------------------------------------

    def _change(self, kind: str, pod: dict[str, Any]) -> None:
        self.version = next(self._rv)
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self.version)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        self.history.append((self.version, kind, pod))
        for w in list(self._watchers):
            if self._selected(pod, w.namespace, w.selector):
                w.queue.put_nowait({"type": kind, "object": pod})

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        labels: dict[str, str],
        annotations: dict[str, str] | None = None,
        ip: str = "127.0.0.1",
        ready: bool = True,
    ) -> None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{namespace}-{name}",
                "labels": dict(labels),
                "annotations": dict(annotations or {}),
            },
            "spec": {"containers": [{"name": "engine", "image": "engine"}]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
        self._change("ADDED", pod)

    def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        pod = json.loads(json.dumps(self.pods[(namespace, name)]))
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self._change("MODIFIED", pod)

    def delete_pod(self, namespace: str, name: str, *, graceful: bool = True) -> None:
        """Graceful: MODIFIED with a deletionTimestamp now; `finish_delete` sends DELETED."""
        pod = json.loads(json.dumps(self.pods[(namespace, name)]))
        if graceful:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            pod["metadata"]["deletionGracePeriodSeconds"] = 30
            self._change("MODIFIED", pod)
        else:
            self._change("DELETED", pod)

    def finish_delete(self, namespace: str, name: str) -> None:
        self._change("DELETED", self.pods[(namespace, name)])

    def bookmark(self) -> str:
        """A BOOKMARK with the current version to every open watch that allows them."""
        self.version = next(self._rv)
        for w in list(self._watchers):
            if w.bookmarks:
                w.queue.put_nowait(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": "Pod",
                            "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self.version)},
                        },
                    }
                )
        return str(self.version)

    def expire_watches(self) -> None:
        """End every open watch stream now (as its timeoutSeconds would)."""
        for w in list(self._watchers):
            w.queue.put_nowait(None)

    def compact(self) -> None:
        """Drop the history: a watch from any version before now gets 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    @property
    def open_watches(self) -> int:
        return len(self._watchers)


def _line(kind: str, pod: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": pod}).encode() + b"\n"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
