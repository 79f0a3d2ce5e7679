"""What a vLLM server's requests share: the sequences running, the length checks, the
prefill's handoffs, and the notification a decode owes its prefill when it drops a request."""

from __future__ import annotations

from typing import Any

from emulator.scheduler import Seq
from emulator.server import EmulatorServer
from emulator.vllm.handoff import Handoffs, skip_remote_kv
from emulator.vllm.request import Lengths


class VllmState:
    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.engine = server.engine
        self.lengths = Lengths(server.max_model_len)
        self.seqs: dict[str, Seq] = {}  # the sequences running, by engine request id
        self.handoffs = Handoffs(server)

    def reject_remote_prefill(self, body: dict[str, Any]) -> None:
        """A decode refusing a request before admission still frees the prefill's blocks held
        for it: vLLM 0.32 submits it pre-aborted (``_with_kv_transfer_rejection_cleanup``,
        entrypoints/generate/base/serving.py; NIXL ``request_finished`` then notifies the
        prefill). Sent in the background: the refusal does not wait for it."""
        ktp = body.get("kv_transfer_params")
        if not isinstance(ktp, dict) or not ktp.get("do_remote_prefill") or self.s.role != "decode":
            return  # (a colocated server has no KV connector to tell: has_kv_connector)
        self.s.notify_in_background(skip_remote_kv(self.s, ktp))  # vLLM only logs a failed notification
