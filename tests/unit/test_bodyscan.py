"""`common.bodyscan.scan_body`: a large body's JSON values counted in slices, strings apart from
the punctuation inside them, escapes never cut in two at a slice's edge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common import bodyscan
from common.bodyscan import TooManyValues, scan_body
from common.errors import BadRequest


def values(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + sum(1 + values(x) for x in v.values())  # (each key a string)
    if isinstance(v, list):
        return 1 + sum(values(x) for x in v)
    return 1


async def fits(body: bytes, cap: int) -> bool:
    try:
        await scan_body(body, cap)
    except TooManyValues:
        return False
    return True


@pytest.mark.parametrize(
    "doc",
    [
        {"prompt": "a, b, [c], {d}, " * 20_000},  # punctuation inside a string: not values
        {"prompt": 'say \\"hi\\", [x]\\\\' * 15_000},  # escapes everywhere, edges included
        {"prompt": list(range(30_000))},
        {"prompt": [[1, 2]] * 20_000},
        {"messages": [{"role": "user", "content": "a,b"}] * 8_000},
        {"prompt": ["a\\", '"b', "c\\\\"] * 8_000},
    ],
)
async def test_the_count_brackets_the_values_a_decoder_meets(doc: dict[str, Any], monkeypatch: Any) -> None:
    monkeypatch.setattr(bodyscan, "WINDOW", 997)  # odd windows: edges fall everywhere
    body = json.dumps(doc).encode()
    n = values(json.loads(body))
    escapes = body.count(b"\\")
    assert await fits(body, 2 * n + escapes // 2 + 2)  # never counts more than about twice
    assert not await fits(body, n - 1)  # nor fewer


async def test_utf8_is_checked_across_slices(monkeypatch: Any) -> None:
    monkeypatch.setattr(bodyscan, "WINDOW", 1000)
    good = json.dumps({"prompt": "é" * 5000}, ensure_ascii=False).encode()
    await scan_body(good, 100)  # a character cut by a slice's edge is fine
    bad = good[:3001] + b"\xff" + good[3002:]
    with pytest.raises(BadRequest, match="at byte 3000"):  # (the character it cuts starts there)
        await scan_body(bad, 100)
    odd = json.dumps({"prompt": "x" + "é" * 5000}, ensure_ascii=False).encode()  # a lead byte at 999
    assert odd[999] == 0xC3
    with pytest.raises(BadRequest, match="at byte 999"):  # cut by the slice's edge: still where it starts
        await scan_body(odd[:1000] + b"\xff" + odd[1001:], 100)
