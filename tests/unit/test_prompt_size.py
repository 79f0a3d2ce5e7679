"""What the length preflight reads of a prompt without a tokenizer (common/prompt.py): a floor
of its UTF-8 length, the largest prompt of a batch, a chat's text only. Found by the API probe:
batches whose prompts together (not each) exceeded a context, and a chat with an inline image,
were refused with a 400 that a direct connection to the engine does not give."""

from __future__ import annotations

import json
import random

import pytest

from common.errors import BadRequest
from common.request import ParsedRequest, parse_request
from common.workers import RouteKind


def parse(route: RouteKind, body: dict[str, object], *, ascii_only: bool = False) -> ParsedRequest:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    return parse_request(route, "/x", raw, default_model="m", max_n=128, max_tokens_cap=None)


def test_a_strings_floor_never_exceeds_its_utf8_length_and_is_exact_without_escapes() -> None:
    rng = random.Random(7)
    alphabet = 'ab \n\t"\\/é中😀\u0001'
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        for ascii_only in (False, True):  # Python's json escapes all non-ASCII by default
            req = parse(RouteKind.COMPLETIONS, {"prompt": text}, ascii_only=ascii_only)
            assert 0 <= req.prompt_peak <= len(text.encode()), (text, ascii_only)
    plain = "hello world, this is plain"
    assert parse(RouteKind.COMPLETIONS, {"prompt": plain}).prompt_peak == len(plain)


def test_a_batch_is_measured_by_its_largest_prompt_and_loads_by_its_sum() -> None:
    req = parse(RouteKind.COMPLETIONS, {"prompt": [[1] * 5000, [2] * 4000]})
    assert (req.prompt_peak, req.prompt_units) == (5000, 9000)
    req = parse(RouteKind.COMPLETIONS, {"prompt": ["a" * 300, "b" * 700]})
    assert (req.prompt_peak, req.prompt_units) == (700, 1000)
    req = parse(RouteKind.GENERATE, {"input_ids": [[1] * 10, [2] * 30]})
    assert (req.prompt_peak, req.prompt_units) == (30, 40)


def test_a_chat_counts_its_text_not_its_images() -> None:
    image = "data:image/png;base64," + "A" * 200_000
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is in"},
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": " this picture?"},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
    }
    req = parse(RouteKind.CHAT, body)
    assert req.prompt_peak == len("be brief") + len("what is in") + len(" this picture?")


def test_echo_with_a_zero_logprobs_in_any_spelling_asks_no_prompt_logprobs_of_sglang() -> None:
    """SGLang scores the prompt only for a non-zero `logprobs`; pydantic reads `"0"`, `0e0`,
    `-0` and `0.00` as 0 (found by the API probe: they were refused on SGLang P/D)."""
    for spelling in (b"0", b"0.0", b"0e0", b"-0", b"0.00", b'"0"', b'" 0 "'):
        body = b'{"prompt":"hi","echo":true,"max_tokens":2,"logprobs":' + spelling + b"}"
        req = parse_request(
            RouteKind.COMPLETIONS, "/x", body, default_model="m", max_n=8, max_tokens_cap=None
        )
        assert req.local_prefill is not None and not req.local_prefill.all_engines, spelling
    body = b'{"prompt":"hi","echo":true,"max_tokens":2,"logprobs":"1"}'
    req = parse_request(RouteKind.COMPLETIONS, "/x", body, default_model="m", max_n=8, max_tokens_cap=None)
    assert req.local_prefill is not None and req.local_prefill.all_engines


def test_the_load_estimate_stays_an_upper_bound() -> None:
    """What must fit a context is a floor; what a request weighs on a worker (accounting,
    admission by tokens, the P/D decider) stays the JSON's length, images included."""
    image = "data:image/png;base64," + "A" * 50_000
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]}
    req = parse(RouteKind.CHAT, body)
    assert req.prompt_peak == 0 and req.prompt_units > 50_000
    text = "中文" * 500
    req = parse(RouteKind.COMPLETIONS, {"prompt": text}, ascii_only=True)
    assert req.prompt_units >= len(text.encode()) >= req.prompt_peak


def test_a_lax_token_id_that_is_no_integer_is_a_400() -> None:
    with pytest.raises(BadRequest):
        parse(RouteKind.COMPLETIONS, {"prompt": [1, "\u00b2"]})  # "²".isdigit() is true


@pytest.mark.parametrize(
    ("route", "body", "max_id", "index_id"),
    [
        (RouteKind.COMPLETIONS, {"prompt": [5, 300]}, 300, 300),
        (RouteKind.COMPLETIONS, {"prompt": "hi"}, -1, -1),
        # stop ids are read as an index only with a minimum length (SGLang's min-new-tokens
        # penalizer scatters them); the configured vocabulary check counts them always
        (RouteKind.COMPLETIONS, {"prompt": [5], "stop_token_ids": [999]}, 999, 5),
        (RouteKind.COMPLETIONS, {"prompt": "hi", "stop_token_ids": [999], "min_tokens": 1}, 999, 999),
        (RouteKind.COMPLETIONS, {"prompt": "hi", "stop_token_ids": [999], "min_tokens": "2"}, 999, 999),
        (RouteKind.COMPLETIONS, {"prompt": "hi", "stop_token_ids": [999], "min_tokens": 0}, 999, -1),
        (RouteKind.COMPLETIONS, {"prompt": "hi", "stop_token_ids": [999], "min_tokens": 0.0}, 999, -1),
        (RouteKind.CHAT, {"messages": [{"role": "user", "content": "x"}], "input_ids": [5, 300]}, 300, 300),
        (
            RouteKind.GENERATE,
            {"text": "hi", "sampling_params": {"stop_token_ids": [999], "min_new_tokens": 1}},
            999,
            999,
        ),
        (
            RouteKind.GENERATE,
            {
                "text": ["a", "b"],
                "sampling_params": [{"stop_token_ids": [7]}, {"stop_token_ids": [9], "min_new_tokens": 3}],
            },
            9,
            9,
        ),
        (RouteKind.GENERATE, {"input_ids": [4], "sampling_params": {"stop_token_ids": [999]}}, 999, 4),
    ],
)
def test_the_ids_an_engine_reads_as_an_index(
    route: RouteKind, body: dict[str, object], max_id: int, index_id: int
) -> None:
    req = parse(route, body)
    assert (req.max_id, req.index_id) == (max_id, index_id)
