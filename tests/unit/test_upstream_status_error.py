"""An engine's 5xx reaches the client (when no other route serves the request) as a message with
the engine's own words as text: it showed a Python bytes repr (`b'{"object":"error",...}'`)."""

from __future__ import annotations

from common.errors import UpstreamFailure, UpstreamRejected
from gateway.orchestration.blame import upstream_status_error as _upstream_status_error

W = "sd"


def test_a_5xx_names_the_engine_s_words_as_text() -> None:
    body = b'{"object":"error","message":"KV cache pool is full \xe2\x80\x94 retry","code":500}\n'
    e = _upstream_status_error(500, body, W, "decode")
    assert isinstance(e, UpstreamFailure) and e.worker == "sd" and e.answered
    assert e.detail == (
        'worker sd answered HTTP 500: {"object":"error","message":"KV cache pool is full \u2014 retry","code":500}'
    )


def test_a_cut_multibyte_character_does_not_fail_the_message() -> None:
    e = _upstream_status_error(503, b"x" * 199 + "\u2014".encode(), W, "prefill")
    assert e.detail.startswith("worker sd answered HTTP 503: xxx") and "b'" not in e.detail


def test_a_4xx_is_the_engine_s_refusal_passed_on() -> None:
    assert isinstance(_upstream_status_error(400, b'{"error":"bad"}', W, "decode"), UpstreamRejected)
