"""Helpers for the e2e tests: the lane's environment, prompts, OpenAI calls, engine metrics.

The lane (tests/e2e/lane.sh) starts the engines and the gateway and exports where they are; the
tests only talk to them over HTTP (the official `openai` client through the gateway and to the
single reference server; plain HTTP for engine metrics).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from openai import AsyncOpenAI, OpenAI

Kind = Literal["chat", "completions"]
KINDS: tuple[Kind, ...] = ("chat", "completions")


@dataclass(frozen=True)
class Lane:
    engine: Literal["vllm", "sglang"]
    model: str
    max_model_len: int
    gateway: str
    reference: str
    prefill: str
    decode: str
    prefill_pgid: int | None
    decode_pgid: int | None
    run_dir: str

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> Lane | None:
        if "E2E_GATEWAY_URL" not in env:
            return None
        engine = env["E2E_ENGINE"]
        if engine not in ("vllm", "sglang"):
            raise ValueError(f"E2E_ENGINE={engine!r}")
        pgid = env.get("E2E_PREFILL_PGID")
        dpgid = env.get("E2E_DECODE_PGID")
        return Lane(
            engine="vllm" if engine == "vllm" else "sglang",
            model=env.get("E2E_MODEL", "tiny"),
            max_model_len=int(env.get("E2E_MAX_MODEL_LEN", "512")),
            gateway=env["E2E_GATEWAY_URL"],
            reference=env["E2E_REFERENCE_URL"],
            prefill=env["E2E_PREFILL_URL"],
            decode=env["E2E_DECODE_URL"],
            prefill_pgid=int(pgid) if pgid else None,
            decode_pgid=int(dpgid) if dpgid else None,
            run_dir=env.get("E2E_RUN_DIR", ""),
        )

    def client(self, base: str, timeout: float = 60.0) -> OpenAI:
        # max_retries=0: a retry in the client would hide what the gateway answered.
        return OpenAI(base_url=base + "/v1", api_key="unused", timeout=timeout, max_retries=0)

    def aclient(self, base: str, timeout: float = 60.0) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=timeout, max_retries=0)


# -- prompts ---------------------------------------------------------------------------------------

_WORDS = (
    "the a of to and in is was for on that with as by at from it this be are or an have not which "
    "cache token prefill decode model server request stream block layer head vector engine queue "
    "river mountain window garden letter silver quiet morning orange planet bridge lantern "
    "capital france paris colour favourite story once upon king castle forest dragon ocean city"
).split()


def _text(rng: random.Random, n_words: int) -> str:
    words = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.7:
            words.append(rng.choice(_WORDS))
        elif r < 0.9:
            words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))))
        else:
            words.append(str(rng.randint(0, 99999)))
    return " ".join(words)


# Word counts chosen so that the completions prompts span about 3..400 tokens with this tokenizer
# (the tests check the real counts the reference server reports).
PROMPT_WORDS = (1, 2, 3, 5, 8, 12, 17, 24, 33, 45, 60, 78, 98, 120, 142, 165)


@dataclass(frozen=True)
class Case:
    idx: int
    prompt: str
    max_tokens: int


def cases() -> list[Case]:
    rng = random.Random(20261129)
    return [Case(i, _text(rng, n), 8 + (i * 7) % 33) for i, n in enumerate(PROMPT_WORDS)]


def unique_prompt(n_words: int, salt: str) -> str:
    """A prompt no server has seen (its prefix differs from every other), so no prefix cache hits."""
    rng = random.Random(f"{salt}-{time.time_ns()}")
    return f"{rng.randrange(10**9)} {_text(rng, n_words)}"


# -- calls -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    token_ids: list[int] | None = None
    chunks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def same_generation(self) -> tuple[str, str | None, int | None, list[int] | None]:
        return (self.text, self.finish_reason, self.completion_tokens, self.token_ids)


def _ids(choice: Any) -> list[int] | None:
    d = choice.model_dump()
    for key in ("token_ids", "response_token_ids"):  # vLLM: token_ids; SGLang chat: response_token_ids
        if d.get(key) is not None:
            return [int(x) for x in d[key]]
    return None


def request_kwargs(
    kind: Kind, model: str, prompt: str, max_tokens: int, stream: bool, **extra_body: Any
) -> dict[str, Any]:
    body: dict[str, Any] = dict(extra_body)
    if not stream:
        body["return_token_ids"] = True  # both engines; SGLang rejects it on chat streams
    kw: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "extra_body": body,
    }
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if kind == "chat":
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    return kw


def call(
    client: OpenAI, kind: Kind, prompt: str, max_tokens: int, stream: bool, model: str, **extra: Any
) -> Outcome:
    kw = request_kwargs(kind, model, prompt, max_tokens, stream, **extra)
    api: Callable[..., Any] = client.chat.completions.create if kind == "chat" else client.completions.create
    if not stream:
        r = api(**kw)
        c = r.choices[0]
        text = (c.message.content or "") if kind == "chat" else c.text
        return Outcome(
            text=text,
            finish_reason=c.finish_reason,
            prompt_tokens=r.usage.prompt_tokens if r.usage else None,
            completion_tokens=r.usage.completion_tokens if r.usage else None,
            token_ids=_ids(c),
            chunks=1,
        )
    parts: list[str] = []
    out = Outcome(text="", finish_reason=None, prompt_tokens=None, completion_tokens=None)
    with api(**kw) as s:
        for chunk in s:
            out.chunks += 1
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.completion_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                piece = (c.delta.content if kind == "chat" else c.text) or ""
                parts.append(piece)
                if c.finish_reason is not None:
                    out.finish_reason = c.finish_reason
    out.text = "".join(parts)
    return out


async def acall(
    client: AsyncOpenAI, kind: Kind, prompt: str, max_tokens: int, stream: bool, model: str
) -> Outcome:
    kw = request_kwargs(kind, model, prompt, max_tokens, stream)
    api: Callable[..., Any] = client.chat.completions.create if kind == "chat" else client.completions.create
    if not stream:
        r = await api(**kw)
        c = r.choices[0]
        text = (c.message.content or "") if kind == "chat" else c.text
        return Outcome(
            text=text,
            finish_reason=c.finish_reason,
            prompt_tokens=r.usage.prompt_tokens if r.usage else None,
            completion_tokens=r.usage.completion_tokens if r.usage else None,
            token_ids=_ids(c),
            chunks=1,
        )
    parts: list[str] = []
    out = Outcome(text="", finish_reason=None, prompt_tokens=None, completion_tokens=None)
    s = await api(**kw)
    async with s:
        async for chunk in s:
            out.chunks += 1
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.completion_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                parts.append((c.delta.content if kind == "chat" else c.text) or "")
                if c.finish_reason is not None:
                    out.finish_reason = c.finish_reason
    out.text = "".join(parts)
    return out


# -- engine metrics ------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> bytes:
    """POST a JSON body straight to a server of the lane (no gateway, no openai client)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # only 127.0.0.1 URLs from the lane
        data: bytes = r.read()
        return data


def post_status(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, bytes]:
    """`post_json` that returns an error answer (status, body) instead of raising."""
    try:
        return 200, post_json(url, body, timeout)
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # only 127.0.0.1 URLs from the lane
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(base: str) -> list[tuple[str, dict[str, str], float]]:
    status, body = http_get(base + "/metrics")
    assert status == 200, f"{base}/metrics answered {status}"
    out = []
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def metric(samples: Iterable[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


# What "an engine is working on a request" means in vLLM's own metrics (SGLang: see busy()).
BUSY_METRICS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
}

GENERATED_TOKENS: dict[str, str] = {
    "vllm": "vllm:generation_tokens_total",
    "sglang": "sglang:generation_tokens_total",
}


def busy(engine: str, base: str) -> dict[str, float]:
    """What the server is working on now, by its own account."""
    if engine == "sglang":
        # SGLang's Prometheus gauges are refreshed only every decode_log_interval (40) steps and
        # every 30 s when idle; /v1/loads is the scheduler's live snapshot (published at once on
        # the busy -> idle transition).
        status, body = http_get(base + "/v1/loads?include=all")
        assert status == 200, (base, status, body[:200])
        out: dict[str, float] = {}
        for load in json.loads(body)["loads"]:
            rank = load.get("dp_rank", 0)
            out[f"num_running_reqs[{rank}]"] = load["num_running_reqs"]
            out[f"num_waiting_reqs[{rank}]"] = load["num_waiting_reqs"]
            for k, v in (load.get("disaggregation") or {}).items():
                if k.endswith("_reqs"):
                    out[f"{k}[{rank}]"] = v
        return out
    s = scrape(base)
    return {name: metric(s, name) for name in BUSY_METRICS[engine]}


def wait_idle(engine: str, bases: Iterable[str], within_s: float) -> dict[str, dict[str, float]]:
    """Polls until every server's busy gauges are 0; returns the last readings (non-zero = busy)."""
    deadline = time.monotonic() + within_s
    while True:
        readings = {b: busy(engine, b) for b in bases}
        if all(v == 0 for r in readings.values() for v in r.values()) or time.monotonic() > deadline:
            return readings
        time.sleep(0.25)
