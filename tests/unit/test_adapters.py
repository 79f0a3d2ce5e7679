"""Adapters checked against exchanges captured from the real engines (tests/fixtures/captures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from adapters import ADAPTERS, HandoffCtx, ProbeInfo
from adapters.prom import sum_metrics
from adapters.sglang import merge_input_logprobs
from common.jsonbytes import iter_sse_data, splice
from common.request import parse_request
from common.workers import Engine, Role, RouteKind, WorkerState

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"
RID = "req-1"
SGL = ADAPTERS[Engine.SGLANG]
VLLM = ADAPTERS[Engine.VLLM]


def capture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CAPTURES / name).read_text())
    return data


def endpoints() -> dict[str, str]:
    data: dict[str, str] = json.loads((CAPTURES / "endpoints.json").read_text())
    return data


def parsed(route: RouteKind, body: dict[str, Any]) -> Any:
    path = {
        RouteKind.GENERATE: "/generate",
        RouteKind.CHAT: "/v1/chat/completions",
        RouteKind.COMPLETIONS: "/v1/completions",
    }[route]
    return parse_request(
        route, path, json.dumps(body).encode(), default_model="m", max_n=8, max_tokens_cap=None
    )


def ctx(
    engine: Engine,
    room: int = 42,
    bootstrap_port: int | None = 31590,
    rid: str = "req-1",
    block_size: int | None = None,
) -> HandoffCtx:
    p = WorkerState(
        id="p",
        url="http://127.0.0.1:31580",
        role=Role.PREFILL,
        engine=engine,
        bootstrap_port=bootstrap_port,
        block_size=block_size,
    )
    d = WorkerState(id="d", url="http://127.0.0.1:31581", role=Role.DECODE, engine=engine)
    return HandoffCtx(request_id=rid, prefill=p, decode=d, room=room)


# ---- SGLang -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang_generate_nonstream.json", "sglang_generate_stream.json"])
def test_sglang_bodies_match_what_the_real_pd_pair_was_sent(name: str) -> None:
    cap = capture(name)
    sent = cap["prefill"]["request"]["body"]
    client = {k: v for k, v in sent.items() if not k.startswith("bootstrap_")}
    req = parsed(RouteKind.GENERATE, client)
    c = ctx(Engine.SGLANG, room=sent["bootstrap_room"], bootstrap_port=sent["bootstrap_port"])
    for leg, body in (("prefill", SGL.prefill_body(req, c)), ("decode", SGL.decode_body(req, c, None))):
        got = json.loads(body)
        # ours, so that /abort_request can name the request: unique (the room in 16 hex digits)
        # first, so no rid extends another's (SGLang aborts by prefix), then the request id
        assert got.pop("rid") == f"{sent['bootstrap_room']:016x}-req-1"
        want = dict(sent)
        if leg == "prefill" and want.get("stream"):
            want["stream"] = False  # the prefill's answer is judged whole, never relayed
        assert got == want


def test_sglang_client_bootstrap_fields_are_replaced_not_duplicated() -> None:
    req = parsed(RouteKind.GENERATE, {"text": "hi", "bootstrap_room": 7, "bootstrap_host": "evil"})
    raw = SGL.prefill_body(req, ctx(Engine.SGLANG, room=9))
    assert raw.count(b"bootstrap_room") == 1
    got = json.loads(raw)
    assert got["bootstrap_room"] == 9 and got["bootstrap_host"] == "127.0.0.1"


def test_sglang_batch_sends_scalar_room_and_no_rid() -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "max_tokens": 3})
    got = json.loads(SGL.prefill_body(req, ctx(Engine.SGLANG, room=100)))
    assert got["bootstrap_room"] == 100 and "rid" not in got
    assert SGL.abort_call(req, "req-1") is None


@pytest.mark.parametrize(
    "name",
    [
        "sglang_generate_nonstream.json",
        "sglang_generate_stream.json",
        "sglang_completions_nonstream.json",
        "sglang_chat_stream_usage.json",
    ],
)
def test_sglang_real_prefill_answers_are_judged_sound(name: str) -> None:
    cap = capture(name)
    body = dict(cap["prefill"]["request"]["body"])
    route = (
        RouteKind.GENERATE
        if "generate" in name
        else (RouteKind.CHAT if "chat" in name else RouteKind.COMPLETIONS)
    )
    req = parsed(route, body)
    v = SGL.judge_prefill(
        req, ctx(Engine.SGLANG), cap["prefill"]["status"], cap["prefill"]["raw_body"].encode()
    )
    assert v.ok, v.reason
    if route is RouteKind.GENERATE:  # what the decode guard reads from the same prefill answer
        raw_p = cap["prefill"]["raw_body"].encode()
        payloads = list(iter_sse_data(raw_p)) if raw_p.startswith(b"data:") else [raw_p]
        s = SGL.summarize(req, payloads)
        assert s.prompt_tokens == 8
        raw = cap["decode"]["raw_body"]
        first = raw.split("data: ", 2)[1].split("\n")[0] if raw.startswith("data: ") else raw
        assert s.first_token_id == json.loads(first)["output_ids"][0]


def test_sglang_prefill_abort_event_on_a_200_stream_is_a_failure() -> None:
    # The #30233 shape seen on real 0.5.23: HTTP 200, one event with finish_reason abort, prompt_tokens 1.
    event = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "prompt_tokens": 1,
            "finish_reason": {
                "type": "abort",
                "message": "Input length (1100 tokens) exceeds the maximum allowed length (1018 tokens).",
                "status_code": 400,
                "err_type": "BadRequestError",
            },
        },
    }
    raw = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
    req = parsed(RouteKind.GENERATE, {"text": "x", "stream": True})
    v = SGL.judge_prefill(req, ctx(Engine.SGLANG), 200, raw)
    assert not v.ok and not v.retryable and v.status == 400 and "exceeds" in v.reason


def test_sglang_prefill_http_errors() -> None:
    req = parsed(RouteKind.GENERATE, {"text": "x"})
    assert not SGL.judge_prefill(req, ctx(Engine.SGLANG), 400, b'{"error":{"message":"too long"}}').retryable
    assert SGL.judge_prefill(req, ctx(Engine.SGLANG), 503, b"").retryable


def test_sglang_logprob_merge_counts_each_prompt_position_once() -> None:
    p = {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None]]}
    d = {"input_token_logprobs": [[None, 1, None]]}
    merge_input_logprobs(p, d)
    assert d["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]


def test_sglang_load_and_info_from_real_endpoints() -> None:
    ep = endpoints()
    load = SGL.parse_load("/metrics", ep["sglang prefill /metrics"].encode())
    assert load is not None and load.running == 0 and load.waiting == 0 and 0.0 <= load.kv_usage <= 1.0
    info = ProbeInfo()
    for path in SGL.info_paths:
        info = SGL.parse_info(path, ep[f"sglang prefill {path}"].encode(), info)
    assert info.model == "./tiny-llama"
    assert info.context_length == 1536 and info.max_input_len == 1018
    assert info.disaggregation_mode == "prefill" and info.bootstrap_port == 31590


def test_sglang_load_from_v1_loads_snapshot() -> None:
    """SGLang 0.5.23's /v1/loads: P/D queues are already in num_waiting_reqs; requests whose KV
    is still being sent (prefill inflight) count as running; DP ranks add up."""
    rank = {
        "dp_rank": 0,
        "num_running_reqs": 3,
        "num_waiting_reqs": 2,
        "token_usage": 0.5,
        "cache_hit_rate": 0.25,
        "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": 9},
        "disaggregation": {
            "mode": "prefill",
            "prefill_inflight_queue_reqs": 4,
            "decode_transfer_queue_reqs": 7,
        },
    }
    body = json.dumps({"version": "0.5.23", "loads": [rank, {**rank, "dp_rank": 1, "token_usage": 0.0}]})
    load = SGL.parse_load("/v1/loads", body.encode())
    assert load is not None
    assert (load.running, load.waiting) == (14, 4) and load.kv_usage == 0.25 and load.cache_hit_rate == 0.25
    assert SGL.parse_load("/v1/loads", b'{"loads": []}') is None
    assert SGL.parse_load("/v1/loads", b"not json") is None


def test_missing_load_gauges_are_unknown_not_zero() -> None:
    """SGLang publishes its scheduler gauges only after logging stats: a /metrics page without
    them says nothing about load."""
    counters_only = "# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 0.0\n"
    assert SGL.parse_load("/metrics", counters_only.encode()) is None
    assert VLLM.parse_load("/metrics", counters_only.encode()) is None
    load = SGL.parse_load("/metrics", b"sglang:num_running_reqs 2.0\nsglang:num_queue_reqs 1.0\n")
    assert load is not None and (load.running, load.waiting) == (2, 1)


# ---- vLLM -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["vllm_completions_nonstream.json", "vllm_chat_nonstream.json", "vllm_chat_stream_usage.json"]
)
def test_vllm_handoff_bodies_match_the_real_exchange(name: str) -> None:
    cap = capture(name)
    client = dict(cap["single"]["request"]["body"])
    route = RouteKind.CHAT if "chat" in name else RouteKind.COMPLETIONS
    req = parsed(route, client)
    c = ctx(Engine.VLLM)
    prefill = json.loads(VLLM.prefill_body(req, c))
    want = dict(cap["prefill"]["request"]["body"])
    for k in ("max_completion_tokens",):
        want.pop(k, None)
        prefill.pop(k, None)
    assert prefill == want
    rid = cap["prefill"]["request"]["headers"]["X-Request-Id"]
    v = VLLM.judge_prefill(
        req, ctx(Engine.VLLM, rid=rid, block_size=16), 200, cap["prefill"]["raw_body"].encode()
    )
    assert v.ok, v.reason
    assert (
        VLLM.summarize(req, [cap["prefill"]["raw_body"].encode()]).prompt_tokens
        == (cap["prefill"]["json"]["usage"]["prompt_tokens"])
    )
    decode = json.loads(VLLM.decode_body(req, c, v))
    assert decode == cap["decode"]["request"]["body"]


def test_vllm_params_are_forwarded_byte_for_byte() -> None:
    cap = capture("vllm_completions_nonstream.json")
    req = parsed(RouteKind.COMPLETIONS, dict(cap["single"]["request"]["body"]))
    raw = cap["prefill"]["raw_body"].encode()
    v = VLLM.judge_prefill(
        req, ctx(Engine.VLLM, rid=cap["prefill"]["request"]["headers"]["X-Request-Id"]), 200, raw
    )
    assert v.kv_params is not None and bytes(v.kv_params) in raw
    assert bytes(v.kv_params) in VLLM.decode_body(req, ctx(Engine.VLLM), v)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"choices": [{"finish_reason": "length"}], "kv_transfer_params": None}, "no kv_transfer_params"),
        (
            {"choices": [{"finish_reason": "length"}], "kv_transfer_params": {"remote_block_ids": [[1]]}},
            "lack",
        ),
        (
            {
                "choices": [{"finish_reason": "abort"}],
                "kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [[1]]},
            },
            "finished",
        ),
    ],
)
def test_vllm_unsound_prefill_answers_are_refused(body: dict[str, Any], why: str) -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "x"})
    v = VLLM.judge_prefill(req, ctx(Engine.VLLM), 200, json.dumps(body).encode())
    assert not v.ok and why in v.reason


def test_vllm_client_kv_transfer_params_never_reach_an_engine() -> None:
    req = parsed(
        RouteKind.COMPLETIONS, {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_engine_id": "z"}}
    )
    assert b"kv_transfer_params" not in VLLM.colocated_body(req, "r")
    assert b'"z"' not in VLLM.prefill_body(req, ctx(Engine.VLLM))
    assert b'"z"' not in VLLM.decode_body(req, ctx(Engine.VLLM), None)


def test_vllm_load_and_info_from_real_endpoints() -> None:
    ep = endpoints()
    load = VLLM.parse_load("/metrics", ep["vllm decode /metrics"].encode())
    assert load is not None and load.running == 0 and load.waiting == 0 and 0.0 <= load.cache_hit_rate <= 1.0
    info = VLLM.parse_info("/v1/models", ep["vllm prefill /v1/models"].encode(), ProbeInfo())
    assert info.model == "tiny" and info.context_length == 512
    info = VLLM.parse_info("/metrics", ep["vllm prefill /metrics"].encode(), info)
    assert info.block_size == 128  # vLLM's CPU backend (500 tokens came with 4 blocks in the captures)


# ---- shared helpers -------------------------------------------------------------------------


def test_splice_keeps_bytes_and_handles_empty_objects() -> None:
    assert splice(b'{"a": 1 }\n', b'"b":2') == b'{"a": 1,"b":2}'
    assert splice(b"{}", b'"b":2') == b'{"b":2}'
    with pytest.raises(ValueError):
        splice(b"[1]", b'"b":2')


def test_sum_metrics_sums_label_sets_and_ignores_lookalikes() -> None:
    text = 'x_total{a="1"} 2.0\nx_total{a="2"} 3\nx_created 99\n# HELP x_total y\nx 7\n'
    assert sum_metrics(text, ["x_total", "x"]) == {"x_total": 5.0, "x": 7.0}


def test_parse_errors_name_the_field() -> None:
    from common.errors import BadRequest

    with pytest.raises(BadRequest) as e:
        parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": "many"})
    assert e.value.param == "max_tokens"
    with pytest.raises(BadRequest):
        parse_request(
            RouteKind.CHAT,
            "/v1/chat/completions",
            b"{not json",
            default_model=None,
            max_n=1,
            max_tokens_cap=None,
        )
    assert msgspec.json.decode(e.value.body())["error"]["type"] == "invalid_request_error"


def test_vllm_params_of_another_request_are_refused() -> None:
    cap = capture("vllm_completions_nonstream.json")
    req = parsed(RouteKind.COMPLETIONS, dict(cap["single"]["request"]["body"]))
    v = VLLM.judge_prefill(
        req, ctx(Engine.VLLM, rid="some-other-request"), 200, cap["prefill"]["raw_body"].encode()
    )
    assert not v.ok and "another request" in v.reason
    body = cap["prefill"]["json"]
    body["kv_transfer_params"]["remote_num_tokens"] = 3
    rid = cap["prefill"]["request"]["headers"]["X-Request-Id"]
    v = VLLM.judge_prefill(req, ctx(Engine.VLLM, rid=rid), 200, json.dumps(body).encode())
    assert not v.ok and "cover 3 tokens" in v.reason
    body = cap["prefill"]["json"]
    body["kv_transfer_params"]["remote_num_tokens"] = 6
    for blocks, bs, ok in (([[]], None, False), ([[1]], 16, True), ([[1]], 4, False), ([[1, 2]], 4, True)):
        body["kv_transfer_params"]["remote_block_ids"] = blocks
        v = VLLM.judge_prefill(req, ctx(Engine.VLLM, rid=rid, block_size=bs), 200, json.dumps(body).encode())
        assert v.ok is ok, (blocks, bs, v.reason)


@pytest.mark.parametrize("engine", [Engine.SGLANG, Engine.VLLM])
@pytest.mark.parametrize(
    "options",
    [
        None,
        {"include_usage": False},
        {"include_usage": False, "continuous_usage_stats": False},
        {"continuous_usage_stats": True},
    ],
)
def test_decode_asks_for_stream_usage_only_when_the_gateway_needs_it(
    engine: Engine, options: dict[str, Any] | None
) -> None:
    """The decode guard needs a stream's token count: the decode leg asks for the usage chunk
    (other stream options kept); the prefill never streams, and without the flag nothing changes."""
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    if options is not None:
        body["stream_options"] = options
    req = parsed(RouteKind.COMPLETIONS, body)
    a = ADAPTERS[engine]
    plain = ctx(engine)
    asked = msgspec.structs.replace(plain, stream_usage=True)
    verdict = None
    if engine is Engine.VLLM:
        prefill = {
            "choices": [{"finish_reason": "length"}],
            "kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [[1]]},
        }
        verdict = a.judge_prefill(req, plain, 200, json.dumps(prefill).encode())
        assert verdict.ok, verdict
    sent = json.loads(a.decode_body(req, asked, verdict))
    want = {**(options or {}), "include_usage": True}
    if engine is Engine.VLLM:
        # vLLM adds per-chunk usage when include_usage is on too: the client asked for none
        want.pop("continuous_usage_stats", None)
    assert sent["stream_options"] == want
    assert sent["prompt"] == "hi" and sent["stream"] is True
    untouched = json.loads(a.decode_body(req, plain, verdict))
    assert untouched.get("stream_options") == options
    assert "include_usage" not in json.dumps(json.loads(a.prefill_body(req, asked)).get("stream_options"))


def test_generate_sampling_params_per_prompt_are_read_for_accounting() -> None:
    sps = [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 40, "top_k": 1}]
    req = parsed(RouteKind.GENERATE, {"text": ["a", "b"], "sampling_params": sps})
    assert (req.max_tokens, req.n, req.greedy, req.batch) == (40, 1, True, 2)
    req = parsed(RouteKind.GENERATE, {"text": ["a", "b"], "sampling_params": [sps[0], {"n": 1}]})
    assert (req.max_tokens, req.greedy) == (3, False)  # the largest given limit; one entry samples
    req = parsed(RouteKind.GENERATE, {"text": ["a", "b"], "sampling_params": [{"n": 3}, {"n": 3}]})
    assert (req.max_tokens, req.n, req.accounting_max_tokens) == (None, 3, 128)


@pytest.mark.parametrize(
    ("route", "extra", "want"),
    [
        (RouteKind.COMPLETIONS, {}, None),
        (RouteKind.COMPLETIONS, {"echo": True}, None),
        (RouteKind.COMPLETIONS, {"logprobs": 2}, None),
        (RouteKind.COMPLETIONS, {"echo": True, "logprobs": None}, None),
        (RouteKind.COMPLETIONS, {"echo": True, "logprobs": 2}, ("echo", True)),
        (RouteKind.COMPLETIONS, {"echo": True, "logprobs": 0}, ("echo", False)),
        (RouteKind.COMPLETIONS, {"prompt_logprobs": 1}, ("prompt_logprobs", False)),
        (RouteKind.COMPLETIONS, {"prompt_logprobs": None}, None),
        (RouteKind.COMPLETIONS, {"echo": True, "max_tokens": 0}, ("max_tokens", False)),
        # vLLM: a chat's echo is prompt_logprobs = top_logprobs (0 by default), so its decode
        # scores the prompt; SGLang's repeats the last message and scores nothing
        (RouteKind.CHAT, {"echo": True, "logprobs": True}, ("echo", False)),
        (RouteKind.CHAT, {"echo": True}, ("echo", False)),
        (RouteKind.CHAT, {"echo": True, "top_logprobs": None}, None),
        (RouteKind.CHAT, {"prompt_logprobs": 0}, ("prompt_logprobs", False)),
        (RouteKind.GENERATE, {"return_logprob": True, "logprob_start_len": 0}, None),  # merged instead
    ],
)
def test_what_needs_the_prompt_computed_where_it_is_answered(
    route: RouteKind, extra: dict[str, Any], want: tuple[str, bool] | None
) -> None:
    if route is RouteKind.COMPLETIONS:
        body: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 3, **extra}
    elif route is RouteKind.CHAT:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    else:
        body = {"model": "m", "text": "hi", **extra}
    req = parsed(route, body)
    lp = req.local_prefill
    assert (None if lp is None else (lp.param, lp.all_engines)) == want
    assert ADAPTERS[Engine.VLLM].supports_pd(req) == (want is None)
    assert ADAPTERS[Engine.SGLANG].supports_pd(req)  # kept off SGLang decodes before planning


@pytest.mark.parametrize(
    ("given", "sent"),
    [(None, None), (0, None), ("0", None), (1, 1), (5, 1), ("3", 1), (2.0, 1), (True, 1)],
)
def test_vllm_prefill_gets_min_tokens_as_at_most_one(given: object, sent: int | None) -> None:
    """The prefill draws its one token under the client's minimum length as the decode draws its
    first (EOS and stop ids held back), but `max_tokens` 1 allows it no more than 1."""
    client: dict[str, object] = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}
    if given is not None:
        client["min_tokens"] = given
    prefill = json.loads(VLLM.prefill_body(parsed(RouteKind.COMPLETIONS, client), ctx(Engine.VLLM)))
    assert prefill.get("min_tokens") == sent and prefill["max_tokens"] == 1


def test_vllm_prefill_is_sent_a_null_min_tokens_to_refuse_it_first() -> None:
    """vLLM refuses `"min_tokens": null` (an int field): the prefill gets it as sent, so that it
    refuses before its work rather than the decode after it (with the prefill's KV held)."""
    client = {"model": "m", "prompt": "hi", "max_tokens": 8, "min_tokens": None}
    prefill = json.loads(VLLM.prefill_body(parsed(RouteKind.COMPLETIONS, client), ctx(Engine.VLLM)))
    assert "min_tokens" in prefill and prefill["min_tokens"] is None and prefill["max_tokens"] == 1


def test_vllm_prefill_stopped_on_its_token_is_sound_without_params() -> None:
    """Newer vLLM ends a prefill whose one token is a stop id "stop", with no KV handed over: a
    sound verdict with no params (the decode computes the prompt). After "length" the same
    missing params stay a failure."""
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 8})
    for finish, ok in (("stop", True), ("length", False)):
        body = {
            "choices": [{"index": 0, "text": "", "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "kv_transfer_params": None,
        }
        v = VLLM.judge_prefill(req, ctx(Engine.VLLM), 200, json.dumps(body).encode())
        assert v.ok is ok and v.kv_params is None, v


def _tie_ctx() -> HandoffCtx:
    return msgspec.structs.replace(ctx(Engine.VLLM), near_ties=3, near_tie_margin=0.2)


@pytest.mark.parametrize(
    ("route", "extra", "want"),
    [
        (RouteKind.COMPLETIONS, {}, {"logprobs": 3}),
        (RouteKind.COMPLETIONS, {"logprobs": 1}, {"logprobs": 1}),  # the client's: validated alike
        (RouteKind.COMPLETIONS, {"logprobs": None}, {"logprobs": 3}),
        (RouteKind.COMPLETIONS, {"echo": True}, {"logprobs": None}),  # echo + logprobs scores the prompt
        (RouteKind.COMPLETIONS, {"temperature": 0.7}, {"logprobs": None}),  # sampled: no ties judged
        (RouteKind.CHAT, {}, {"logprobs": True, "top_logprobs": 3}),
        (RouteKind.CHAT, {"logprobs": False}, {"logprobs": True, "top_logprobs": 3}),
        (RouteKind.CHAT, {"logprobs": True}, {"logprobs": True, "top_logprobs": 3}),
        (RouteKind.CHAT, {"logprobs": True, "top_logprobs": 1}, {"logprobs": True, "top_logprobs": 1}),
        (RouteKind.CHAT, {"top_logprobs": 2}, {"logprobs": None, "top_logprobs": 2}),  # vLLM's 400, as sent
    ],
)
def test_vllm_greedy_prefill_is_asked_for_its_best_first_tokens(
    route: RouteKind, extra: dict[str, Any], want: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "temperature": 0, **extra}
    if route is RouteKind.CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    req = parsed(route, body)
    prefill = json.loads(VLLM.prefill_body(req, _tie_ctx()))
    assert {k: prefill.get(k) for k in want} == want
    # not asked for (guards off, `near_tie_alternatives = 0`): the body is the client's
    plain = json.loads(VLLM.prefill_body(req, ctx(Engine.VLLM)))
    assert {k: plain.get(k) for k in want} == {k: extra.get(k) for k in want}


def _answer_with(logprobs: dict[str, Any], chat: bool) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": logprobs}
    choice.update({"message": {"role": "assistant", "content": "a"}} if chat else {"text": "a"})
    return json.dumps(
        {
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "kv_transfer_params": {
                "remote_engine_id": "e",
                "remote_request_id": "cmpl-req-1-0-ab",
                "remote_block_ids": [[1]],
                "remote_num_tokens": 3,
            },
        }
    ).encode()


def test_vllm_prefill_verdict_names_the_tokens_near_tied_with_its_own() -> None:
    """Tokens within the margin of the drawn one (by the prefill's own logprobs) are its ties;
    further ones are not, nor is the drawn token itself."""
    comp = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0})
    lp = {
        "text_offset": [0],
        "token_logprobs": [-0.5],
        "tokens": ["a"],
        "top_logprobs": [{"a": -0.5, " b": -0.62, "c": -0.71, "d": -3.0}],
    }
    v = VLLM.judge_prefill(comp, _tie_ctx(), 200, _answer_with(lp, False))
    assert v.ok and v.ties == (" b",)
    chat = parsed(
        RouteKind.CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
    )
    tops = [{"token": t, "logprob": x, "bytes": []} for t, x in (("a", -0.5), ("b", -0.6), ("c", -0.69))]
    clp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": tops}]}
    v = VLLM.judge_prefill(chat, _tie_ctx(), 200, _answer_with(clp, True))
    assert v.ok and v.ties == ("b", "c")
    # not asked: not read; malformed or absent logprobs: no ties, the verdict stands
    assert VLLM.judge_prefill(chat, ctx(Engine.VLLM), 200, _answer_with(clp, True)).ties == ()
    for bad in ({"content": None}, {"tokens": []}, {"content": [{"token": 1}]}):
        v = VLLM.judge_prefill(chat, _tie_ctx(), 200, _answer_with(bad, True))
        assert v.ok and v.ties == ()


def _kv_answer(prompt: int, groups: list[list[int]], covered: int | None = None, dcp: int = 1) -> bytes:
    """A vLLM prefill's answer for a prompt of `prompt` tokens, its KV in `groups` of block ids."""
    return json.dumps(
        {
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1},
            "kv_transfer_params": {
                "remote_engine_id": "e",
                "remote_request_id": "cmpl-req-1-0-ab",
                "remote_block_ids": groups,
                "remote_num_tokens": prompt if covered is None else covered,
                "dcp_size": dcp,
            },
        }
    ).encode()


@pytest.mark.parametrize(
    ("answer", "sound", "same_first"),
    [
        # one full attention group: ceil(271 / 16) = 17 blocks
        (_kv_answer(271, [list(range(17))]), True, True),
        (_kv_answer(271, [list(range(9))]), False, True),
        # a sliding window group holds only its window's blocks (vLLM clips them): the full
        # attention group is judged, the other must not be empty
        (_kv_answer(271, [list(range(17)), list(range(9))]), True, True),
        (_kv_answer(271, [list(range(9)), list(range(9))]), False, True),
        (_kv_answer(271, [list(range(17)), []]), False, True),
        # decode context parallelism: a block spans the ranks' tokens, the count is not judged
        (_kv_answer(271, [list(range(9))], dcp=2), True, True),
        # a hybrid (Mamba) model's prefill computes all but the last prompt token, its state in
        # one block: sound, but its sampled token is no measure of the decode's first
        (_kv_answer(271, [list(range(17)), [5]], covered=270), True, False),
        (_kv_answer(271, [list(range(17))], covered=270), False, True),
        (_kv_answer(271, [list(range(17)), [5]], covered=269), False, True),
    ],
)
def test_vllm_kv_shapes_of_every_kind_of_model(answer: bytes, sound: bool, same_first: bool) -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 4})
    v = VLLM.judge_prefill(req, ctx(Engine.VLLM, block_size=16), 200, answer)
    assert v.ok is sound, v.reason
    if sound:
        assert v.same_first_token is same_first
