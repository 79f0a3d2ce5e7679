"""`pd-gateway demo` (what `make run` starts), as a user meets it: a subprocess on a free port,
the official openai client against each of its three models, and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from openai import OpenAI

MODELS = ("demo-sglang", "demo-vllm", "demo-colocated")


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_gateway.cli", "demo", "--port", "0", "--time-scale", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    url = None
    seen = []
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"gateway on (http://\S+)", line)
        url = m.group(1) if m else None
    assert url, "".join(seen)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
        try:
            rc = proc.wait(timeout=30)
        finally:
            proc.kill()
        assert rc == 0, proc.stdout.read()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", MODELS)
def test_the_openai_client_gets_answers_from_every_demo_model(demo: str, model: str, stream: bool) -> None:
    client = OpenAI(base_url=demo + "/v1", api_key="none", max_retries=0, timeout=30)
    assert {m.id for m in client.models.list().data} == set(MODELS)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = client.completions.create(model=model, prompt="once upon a time", max_tokens=8, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 8 and r.choices[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat_input_ids"])
@pytest.mark.parametrize("model", MODELS)
def test_a_token_id_beyond_the_vocabulary_is_a_400_and_kills_no_worker(
    demo: str, model: str, chat: bool
) -> None:
    """The emulator's SGLang dies on such an id, as the real one does: the demo tells the gateway
    the emulator's vocabulary, so the gateway refuses the id instead (SGLang's chat reads
    `input_ids` as its prompt)."""
    ids = [1, 2, 1_000_000]
    fields = {"messages": [{"role": "user", "content": "hi"}], "input_ids": ids} if chat else {"prompt": ids}
    body = json.dumps({"model": model, **fields, "max_tokens": 2}).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    rq = urllib.request.Request(demo + path, body, {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(rq, timeout=30)
    assert ei.value.code == 400
    assert "out of vocabulary" in json.loads(ei.value.read())["error"]["message"]
    client = OpenAI(base_url=demo + "/v1", api_key="none", max_retries=0, timeout=30)
    r = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2
