"""KV-integrity guards with the real engines in the loop.

A second gateway is started for this module (`pd-gateway serve`, as a user would), with the
lane's real prefill behind a fault proxy (tests/e2e/faultproxy.py), the real decode, and the
single reference server as its colocated fallback worker. The proxy breaks one prefill exchange
at a time the ways real engines were seen to go wrong (tests/e2e/README.md, "Failures seen on the
real engines"):

- vLLM, stale or foreign `kv_transfer_params`: unguarded, the real decode answers 200 with
  another prompt's tokens; too-short or empty block lists: unguarded, the decode engine dies.
- SGLang, the prefill refusing (or dropping) a request the decode accepted: unguarded, the real
  decode waits 300 s for KV that never comes.

Through the gateway none of that may reach a client or an engine: each request ends quickly with
exactly the reference server's tokens (refused, then recovered) or a clear error; the guard that
caught it is counted; the decode stays alive and idle, and serves the next P/D request correctly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e._support import (
    Case,
    Kind,
    Lane,
    Outcome,
    call,
    http_get,
    metric,
    scrape,
    unique_prompt,
    wait_idle,
)
from tests.e2e._ties import unexplained_departure
from tests.e2e.faultproxy import SGLANG_MODES, VLLM_MODES, FaultProxy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

QUICK_S = 20.0  # a refused handoff must end far sooner than SGLang's 300 s KV wait


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GuardedGateway:
    def __init__(self, url: str, proxy: FaultProxy, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proxy = proxy
        self.proc = proc

    def guard_hits(self, guard: str) -> float:
        return metric(scrape(self.url), "pdgw_guard_failures_total", guard=guard)


@pytest.fixture(scope="module")
def guarded(lane: Lane) -> Iterator[GuardedGateway]:
    proxy = FaultProxy(lane.prefill, lane.engine)
    proxy.start()
    port = _free_port()
    prefill = [proxy.url]
    if lane.engine == "sglang":
        bootstrap = os.environ.get("E2E_BOOTSTRAP_PORT")
        assert bootstrap, "the lane did not export E2E_BOOTSTRAP_PORT"
        prefill.append(bootstrap)
    argv = [
        str(Path(sys.executable).parent / "pd-gateway"),
        "serve",
        "--engine",
        lane.engine,
        "--prefill",
        *prefill,
        "--decode",
        lane.decode,
        "--worker",
        lane.reference,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "info",
    ]
    log = open(os.path.join(lane.run_dir or "/tmp", "gateway-guards.log"), "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http_get(url + "/readiness", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, "the guarded gateway exited while starting"
            assert time.monotonic() < deadline, "the guarded gateway was not ready in 60 s"
            time.sleep(0.3)
        yield GuardedGateway(url, proxy, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        proxy.stop()


def _clean_pd_request(lane: Lane, g: GuardedGateway, kind: Kind) -> None:
    """A normal request through the guarded gateway: P/D, and the reference's tokens (or a
    departure from them only at a near tie of the reference's own top two, as in test_pd.py: a
    departure anywhere else is what KV left wrong on the decode by a broken handoff would look
    like)."""
    case = Case(-1, unique_prompt(12, "guard-clean"), 12)
    want = call(lane.client(lane.reference), kind, case.prompt, case.max_tokens, False, lane.model)
    hits, forwarded = g.proxy.hits, g.proxy.forwarded
    decode = _DecodeLedger(lane)
    got = call(lane.client(g.url), kind, case.prompt, case.max_tokens, False, lane.model)
    assert g.proxy.hits == hits and g.proxy.forwarded == forwarded + 1, "not served P/D"
    sources = decode.delta()
    why = unexplained_departure(
        lane, lane.client(g.url), lane.client(lane.reference), kind, case, False, got, want, want
    )
    assert why is None, (
        f"clean P/D request: {got.same_generation()} != {want.same_generation()}: {why}; {sources}"
    )


class _DecodeLedger:
    """vLLM: what the decode served between two readings: requests finished, and where their
    prompt tokens came from (`external_kv_transfer`: pulled; `local_cache_hit`: its own prefix
    cache, where blocks left wrong by a broken handoff would be read from)."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        if self.lane.engine != "vllm":
            return {}
        d = scrape(self.lane.decode)
        src = "vllm:prompt_tokens_by_source_total"
        return {
            "requests": metric(d, "vllm:request_success_total"),
            **{
                s: metric(d, src, source=s)
                for s in ("external_kv_transfer", "local_cache_hit", "local_compute")
            },
        }

    def delta(self) -> dict[str, float]:
        return {k: v - self.before[k] for k, v in self._read().items()}


def _decode_is_sound(lane: Lane) -> None:
    status, _ = http_get(lane.decode + "/health", timeout=10)
    assert status == 200, "the decode server is down"
    readings = wait_idle(lane.engine, (lane.decode,), within_s=15)
    assert all(v == 0 for r in readings.values() for v in r.values()), (
        f"the decode is left holding work: {readings}"
    )


# (mode, words in the prompt, kind, stream): stale/foreign params on a prompt of one KV block (the
# case where real vLLM answers wrong tokens), short/empty block lists on a prompt of three blocks
VLLM_CASES: list[tuple[str, int, Kind, bool]] = [
    ("stale", 12, "completions", False),
    ("stale", 12, "chat", True),
    ("foreign", 20, "completions", True),
    ("foreign", 20, "chat", False),
    ("short", 150, "completions", False),
    ("short", 150, "chat", True),
    ("empty", 150, "completions", True),
    ("empty", 40, "chat", False),
]
SGLANG_CASES: list[tuple[str, int, Kind, bool]] = [
    ("reject", 20, "completions", False),
    ("reject", 20, "chat", True),
    ("drop", 20, "completions", True),
    ("drop", 20, "chat", False),
]


# the lane's engine is known when the tests are collected (without a lane they are skipped)
CASES = VLLM_CASES if os.environ.get("E2E_ENGINE") == "vllm" else SGLANG_CASES


@pytest.mark.parametrize(
    ("mode", "words", "kind", "stream"),
    CASES,
    ids=[f"{m}-{k}-{'stream' if s else 'whole'}" for m, _, k, s in CASES],
)
def test_a_broken_handoff_never_reaches_a_client_or_an_engine(
    lane: Lane, guarded: GuardedGateway, mode: str, words: int, kind: Kind, stream: bool
) -> None:
    assert mode in (VLLM_MODES if lane.engine == "vllm" else SGLANG_MODES)
    _clean_pd_request(lane, guarded, kind)  # also gives 'stale' an intact, consumed handoff to reuse
    case = Case(-1, unique_prompt(words, f"guard-{mode}"), 16)
    want = call(lane.client(lane.reference), kind, case.prompt, case.max_tokens, stream, lane.model)
    verdicts = guarded.guard_hits("prefill_verdict")
    hits, forwarded = guarded.proxy.hits, guarded.proxy.forwarded
    decode = _DecodeLedger(lane)
    guarded.proxy.arm(mode)
    t0 = time.monotonic()
    try:
        client = lane.client(guarded.url, timeout=QUICK_S + 10)
        got = call(client, kind, case.prompt, case.max_tokens, stream, lane.model)
    except openai.APIStatusError as e:
        # a clear refusal is allowed only where the engine itself refused (SGLang 'reject': the
        # prefill's own 400 about the request) and it must come fast, in OpenAI's shape
        elapsed = time.monotonic() - t0
        assert mode == "reject" and e.status_code == 400, (
            f"{mode}: HTTP {e.status_code} {e.response.text[:300]}"
        )
        assert elapsed < QUICK_S, f"{mode}: the refusal took {elapsed:.1f}s"
        assert e.response.json()["error"]["message"]
    else:
        elapsed = time.monotonic() - t0
        assert elapsed < QUICK_S, f"{mode}: took {elapsed:.1f}s"
        _decode_got_no_broken_handoff(lane, guarded, decode, forwarded)
        why = _departure(lane, guarded, kind, case, stream, got, want)
        assert why is None, f"{mode}: delivered other tokens than the reference: {why}"
    assert guarded.proxy.hits == hits + 1, "the fault was not injected"
    if lane.engine == "vllm" or mode == "reject":
        # vLLM: the engine said 200 but its params were unsound: the verdict refused them.
        # SGLang: the prefill refused what its decode took (it would wait for KV): the guard's
        # catch, unlike a request both refuse (test_edges.py's invalid parameters)
        assert guarded.guard_hits("prefill_verdict") == verdicts + 1
    _decode_is_sound(lane)
    _clean_pd_request(lane, guarded, kind)  # the pair still works, with P/D


def _departure(
    lane: Lane, g: GuardedGateway, kind: Kind, case: Case, stream: bool, got: Outcome, want: Outcome
) -> str | None:
    """Why `got` (through the guarded gateway: refused, then served again P/D or by the fallback)
    is not the reference's answer `want`, None where it is (a departure at a near tie included)."""
    reference = lane.client(lane.reference)
    whole = want if not stream else call(reference, kind, case.prompt, case.max_tokens, False, lane.model)
    return unexplained_departure(lane, lane.client(g.url), reference, kind, case, stream, got, want, whole)


def _decode_got_no_broken_handoff(
    lane: Lane, g: GuardedGateway, decode: _DecodeLedger, forwarded: int
) -> None:
    """vLLM: the decode served exactly one request per prefill the proxy passed on intact (the
    retry's), none with the broken handoff's params, so nothing could have put the broken
    handoff's KV into its prefix cache. (Real vLLM serves stale params with a 200 and counts
    it.) Its counters are read until they agree, for a few seconds."""
    if lane.engine != "vllm":
        return
    intact = g.proxy.forwarded - forwarded
    deadline = time.monotonic() + 5
    while (served := decode.delta()["requests"]) != intact and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served == intact, f"the decode served {served} requests for {intact} intact prefills"
