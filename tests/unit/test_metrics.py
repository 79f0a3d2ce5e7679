"""The gateway's own lock-free metric children, exposed through prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counter_and_histogram_exposition() -> None:
    m = GatewayMetrics()
    c = m.child(m.requests, "chat", "m", "disaggregated", "ok")
    c.inc()
    c.inc(2)
    h = m.child(m.e2e, "chat", "disaggregated")
    for v in (0.0005, 0.001, 0.02, 400.0):  # below the first bound, on a bound, inside, past the last
        h.observe(v)
    got = _samples(m)
    lab = (("model", "m"), ("outcome", "ok"), ("plan", "disaggregated"), ("route", "chat"))
    assert got[("pdgw_requests_total", lab)] == 3.0
    hl = (("plan", "disaggregated"), ("route", "chat"))
    assert got[("pdgw_request_duration_seconds_bucket", (("le", "0.001"), *hl))] == 2.0  # le is inclusive
    assert got[("pdgw_request_duration_seconds_bucket", (("le", "0.025"), *hl))] == 3.0
    assert got[("pdgw_request_duration_seconds_bucket", (("le", "300.0"), *hl))] == 3.0
    assert got[("pdgw_request_duration_seconds_bucket", (("le", "+Inf"), *hl))] == 4.0
    assert got[("pdgw_request_duration_seconds_count", hl)] == 4.0
    assert got[("pdgw_request_duration_seconds_sum", hl)] == pytest.approx(400.0215)


def test_children_are_kept_and_labels_checked() -> None:
    m = GatewayMetrics()
    assert m.child(m.retries, "prefill") is m.child(m.retries, "prefill")
    with pytest.raises(ValueError, match="expected labels"):
        m.child(m.e2e, "chat")
    with pytest.raises(ValueError):
        m.child(m.retries, "prefill").inc(-1)


def test_fixed_label_children_appear_at_their_first_observation_and_add_up() -> None:
    """The request path's fixed-label observations (`phase_prefill`, `hold_end`, ...) look their
    child up once: no series before the first observation (as `child()`), then the same child
    as `child()` returns, every observation counted."""
    m = GatewayMetrics()
    assert not any(k[0].startswith("pdgw_phase_duration_seconds") for k in _samples(m))
    m.phase_prefill.observe(0.002)
    m.phase_prefill.observe(0.004)
    m.child(m.phase, "prefill").observe(0.5)
    m.hold_end.observe(0.0)
    got = _samples(m)
    assert got[("pdgw_phase_duration_seconds_count", (("phase", "prefill"),))] == 3.0
    assert got[("pdgw_phase_duration_seconds_sum", (("phase", "prefill"),))] == pytest.approx(0.506)
    assert ("pdgw_phase_duration_seconds_count", (("phase", "decode"),)) not in got
    assert got[("pdgw_prefill_verdict_hold_seconds_count", (("held", "end"),))] == 1.0
    assert ("pdgw_prefill_verdict_hold_seconds_count", (("held", "first_byte"),)) not in got
