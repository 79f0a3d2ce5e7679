"""What follows a worker joining or leaving the registry (`Registry.watch`), wherever the change
came from (the configuration, the admin API, discovery):

- joining: its engine's KV-event stream is subscribed to, where it has `[workers.kv_events]`;
- leaving: the policy is told (`WorkerGone`: its cache indexes, queues and prediction figures
  forget the worker) and its KV-event subscription ends, its entries leaving the index.
"""

from __future__ import annotations

from gateway.kvevents.hub import KvEventHub
from gateway.logging import get_logger
from gateway.registry import Worker
from policies.base import Policy, WorkerGone

log = get_logger("pd_gateway.membership")


class Membership:
    """A `MembershipWatcher` for one gateway's policy and KV-event hub."""

    def __init__(self, policy: Policy, hub: KvEventHub) -> None:
        self.policy = policy
        self.hub = hub

    def worker_added(self, worker: Worker) -> None:
        kv = worker.kv_events
        if kv is not None:
            self.hub.add(worker.id, worker.engine, kv)
            log.info("kv_events.subscribed", worker=worker.id, endpoint=kv.endpoint)

    def worker_removed(self, worker: Worker) -> None:
        self.policy.observe(WorkerGone(worker.id))
        if worker.kv_events is not None:
            self.hub.drop(worker.id)
