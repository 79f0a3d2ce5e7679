"""Kubernetes pod discovery with kubernetes-asyncio: list, then watch, the pods of each role.

For each role with a selector (`[kubernetes] prefill_selector`, ...) one loop keeps that role's
workers equal to the ready pods the selector matches:

- **list** (`GET .../pods?labelSelector=`): every matching pod; the list's `resourceVersion` is
  where the watch starts. A worker of this role that the list no longer has is removed.
- **watch** from that version with `allowWatchBookmarks` and `timeoutSeconds`: ADDED / MODIFIED
  set the pod's worker (or its absence, when the pod is not ready), DELETED removes it, BOOKMARK
  only moves the version on. When the server ends the watch (its timeout), it is watched again
  from the last version seen, with no relist. A `410 Gone` (the version was compacted away) means
  events were missed: list again. A failed request is retried after `retry_s` from where it was.

A pod is a worker while it is Running, Ready, has an IP and no deletion timestamp. Its worker is
`{namespace}/{name}`, at `scheme://podIP:port` (`port`, or the pod's `port_annotation`), with its
engine and model from the `engine_label` / `model_label` labels (else `engine`, and the model
probed), and an SGLang prefill's bootstrap port from `bootstrap_port_annotation` (else 8998).
Changes reach the registry through `WorkerSync`: an unready or deleted pod's worker is drained,
its in-flight requests finish (within `drain_timeout_s`), then it is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import msgspec

from adapters import ADAPTERS
from common.workers import Engine, Role
from gateway.config import SGLANG_DEFAULT_BOOTSTRAP_PORT, ConfigError, KubernetesConfig, WorkerConfig
from gateway.discovery.sync import WorkerSync
from gateway.logging import get_logger

log = get_logger("pd_gateway.discovery")

_GONE = 410


class PodError(ValueError):
    """A pod's labels or annotations cannot make a worker (logged, the pod skipped)."""


def pod_ready(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def pod_id(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def pod_worker(pod: Mapping[str, Any], role: Role, cfg: KubernetesConfig) -> WorkerConfig | None:
    """The worker a pod stands for, or None while it is not ready. PodError if it cannot be one."""
    if not pod_ready(pod):
        return None
    meta = pod.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    notes: Mapping[str, str] = meta.get("annotations") or {}
    ip = str((pod.get("status") or {})["podIP"])
    port = _port(notes, cfg.port_annotation, cfg.port)
    engine_name = labels.get(cfg.engine_label, cfg.engine.value)
    try:
        engine = Engine(engine_name)
    except ValueError:
        raise PodError(f"label {cfg.engine_label}={engine_name!r}: not sglang, vllm or openai") from None
    bootstrap = None
    if role is Role.PREFILL and ADAPTERS[engine].prefill_bootstrap:
        bootstrap = _port(notes, cfg.bootstrap_port_annotation, SGLANG_DEFAULT_BOOTSTRAP_PORT)
    host = f"[{ip}]" if ":" in ip else ip
    try:
        return WorkerConfig(
            url=f"{cfg.scheme}://{host}:{port}",
            role=role,
            engine=engine,
            id=pod_id(pod),
            model=labels.get(cfg.model_label) or None,
            bootstrap_port=bootstrap,
            labels={"namespace": str(meta.get("namespace", "")), "pod": str(meta.get("name", ""))},
        )
    except (ValueError, msgspec.ValidationError) as e:
        raise PodError(str(e)) from None


def _port(notes: Mapping[str, str], key: str, default: int) -> int:
    value = notes.get(key)
    if value is None:
        return default
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise PodError(f"annotation {key}={value!r}: not a port")
    return port


class KubernetesDiscovery:
    def __init__(self, cfg: KubernetesConfig, sync: WorkerSync) -> None:
        try:
            import kubernetes_asyncio  # noqa: F401
        except ImportError:  # pragma: no cover - installed with the `kubernetes` extra
            raise ConfigError(
                "[kubernetes] discovery needs kubernetes-asyncio: pip install 'pd-gateway[kubernetes]'"
            ) from None
        self.cfg = cfg
        self.sync = sync
        self._api: Any = None  # kubernetes_asyncio.client.ApiClient
        self._tasks: list[asyncio.Task[None]] = []
        self._owned: dict[Role, set[str]] = {role: set() for role in cfg.selectors()}
        # counters the tests (and the logs) read: lists, watches started, relists after 410
        self.lists = 0
        self.watches = 0
        self.relists = 0
        self.watch_versions: list[str | None] = []  # the resourceVersion each watch started from

    async def _client(self) -> Any:
        """An API client for `api_url`, `kubeconfig` or the pod's service account; ConfigError
        when none can be made (not in a cluster, an unreadable kubeconfig)."""
        from kubernetes_asyncio import client, config

        try:
            if self.cfg.api_url:
                conf = client.Configuration(host=self.cfg.api_url.rstrip("/"))
            elif self.cfg.kubeconfig:
                conf = client.Configuration()
                await config.load_kube_config(config_file=self.cfg.kubeconfig, client_configuration=conf)
            else:
                conf = client.Configuration()
                config.load_incluster_config(client_configuration=conf)
        except (config.ConfigException, OSError, ValueError) as e:
            where = self.cfg.kubeconfig or "the pod's service account (not running in a cluster?)"
            raise ConfigError(f"kubernetes: cannot reach the API with {where}: {e}") from None
        return client.ApiClient(conf)

    async def start(self, first_list_timeout_s: float = 10.0) -> None:
        """List each role once (so the workers known at start are in before the gateway listens,
        as far as `first_list_timeout_s` allows), then watch in the background."""
        self._api = await self._client()
        versions: dict[Role, str | None] = {}
        for role, selector in self.cfg.selectors().items():
            try:
                async with asyncio.timeout(first_list_timeout_s):
                    versions[role] = await self._relist(role, selector)
            except Exception as e:
                log.warning("discovery.list_failed", role=role.value, selector=selector, error=_err(e))
                versions[role] = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(first_list_timeout_s):
                await self.sync.settled()
        self._tasks = [
            asyncio.create_task(self._run(role, selector, versions[role]), name=f"k8s-{role.value}")
            for role, selector in self.cfg.selectors().items()
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self.sync.close()
        if self._api is not None:
            await self._api.close()
            self._api = None

    # -- list + watch ----------------------------------------------------------------------------

    def _list_call(self) -> tuple[Any, tuple[Any, ...]]:
        from kubernetes_asyncio import client

        core = client.CoreV1Api(self._api)
        if self.cfg.namespace:
            return core.list_namespaced_pod, (self.cfg.namespace,)
        return core.list_pod_for_all_namespaces, ()

    async def _run(self, role: Role, selector: str, version: str | None) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        while True:
            try:
                if version is None:
                    version = await self._relist(role, selector)
                version = await self._watch(role, selector, version)
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status == _GONE:
                    self.relists += 1
                    log.info("discovery.relist", role=role.value, reason="410 Gone: events were missed")
                    version = None
                    continue
                log.warning("discovery.api_error", role=role.value, status=e.status, error=_err(e))
                await asyncio.sleep(self.cfg.retry_s)
            except Exception as e:  # connection refused, reset, timeouts: retry from where it was
                log.warning("discovery.watch_failed", role=role.value, error=_err(e))
                await asyncio.sleep(self.cfg.retry_s)

    async def _relist(self, role: Role, selector: str) -> str | None:
        func, args = self._list_call()
        resp = await func(*args, label_selector=selector, _preload_content=False)
        try:
            body = msgspec.json.decode(await resp.read())
        finally:
            resp.release()
        self.lists += 1
        seen: dict[str, WorkerConfig | None] = {}
        for pod in body.get("items") or ():
            seen[pod_id(pod)] = self._worker(pod, role)
        for wid in self._owned[role] - seen.keys():
            self._set(role, wid, None)
        for wid, wc in seen.items():
            self._set(role, wid, wc)
        version = (body.get("metadata") or {}).get("resourceVersion")
        log.info("discovery.listed", role=role.value, pods=len(seen), resource_version=version)
        return str(version) if version is not None else None

    async def _watch(self, role: Role, selector: str, version: str | None) -> str | None:
        from kubernetes_asyncio import watch

        func, args = self._list_call()
        self.watches += 1
        self.watch_versions.append(version)
        w = watch.Watch(return_type="object")
        kwargs: dict[str, Any] = {
            "label_selector": selector,
            "allow_watch_bookmarks": True,
            "timeout_seconds": max(1, int(self.cfg.watch_timeout_s)),
        }
        if version is not None:
            kwargs["resource_version"] = version
        async with w:
            async for event in w.stream(func, *args, **kwargs):
                kind = event["type"]
                obj = event["raw_object"]
                version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if kind == "BOOKMARK":
                    continue
                wid = pod_id(obj)
                if kind == "DELETED":
                    self._set(role, wid, None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._set(role, wid, self._worker(obj, role))
        return version

    def _worker(self, pod: Mapping[str, Any], role: Role) -> WorkerConfig | None:
        try:
            return pod_worker(pod, role, self.cfg)
        except PodError as e:
            log.error("discovery.pod_skipped", pod=pod_id(pod), role=role.value, error=str(e))
            return None

    def _set(self, role: Role, wid: str, wc: WorkerConfig | None) -> None:
        for other, ids in self._owned.items():
            if other is not role and wid in ids:
                if wc is not None:
                    log.warning("discovery.pod_in_two_roles", pod=wid, roles=[other.value, role.value])
                return
        if wc is None:
            self._owned[role].discard(wid)
        else:
            self._owned[role].add(wid)
        self.sync.set(wid, wc)


def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
