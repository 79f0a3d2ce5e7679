"""The project stands alone: no tracked file points outside the repository.

Code, tests and docs once cited notes kept beside the checkout (a `shared` folder one level
up) and paths of the machine they were written on. A reader of the repository has neither: a
fact needed here is copied in with its original source (an engine's version and file, a public
issue, the date it was measured). This reads every tracked text file and fails on such a
pointer, naming file and line; `test_the_check_finds_a_pointer` shows it fails on one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (spelled in pieces so that this file does not match itself)
_UP = r"\.\./"
FORBIDDEN = re.compile(
    "|".join(
        (
            rf"(?:{_UP})+shar" + r"ed\b",  # the notes beside the checkout, from any depth
            r"/wo" + r"rk/",  # the machine's own paths
            r"\b(?:PERF_" + r"NOTES|REAL_" + r"ENGINES|POLICY_" + r"ANCHORS|STYLE_" + r"ANCHORS)\b",
            r"\b(?:PROTO" + r"COLS|FIND" + r"INGS)\.md\b",  # the notes' names, without a path
        )
    )
)
_MAX_BYTES = 4 << 20  # larger tracked files are data (traces), not prose


def tracked_files(root: Path) -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError):  # pragma: no cover - an export without git
        pytest.skip("not a git checkout")
    return [root / name for name in out.decode().split("\0") if name]


def pointers(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line that points outside the repository."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]


def test_no_tracked_file_points_outside_the_repository() -> None:
    found = []
    for path in tracked_files(ROOT):
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in pointers(text)]
    assert not found, "copy the fact in with its original source instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "See " + "../" + "shared/REAL_" + "ENGINES.md.",
        "(see ../../../../" + "shared/captures/x.json)",
        "cd /wo" + "rk/main && make",
        "PERF_" + "NOTES' design b",
        "(PROTO" + "COLS.md 1.2.7)",
    ],
)
def test_the_check_finds_a_pointer(line: str) -> None:
    assert pointers(f"fine\n{line}\n") == [(2, line)]


def test_the_check_leaves_ordinary_words() -> None:
    text = "the shared table\nshared/ memory\nwork/ done\n../docs/benchmarks.md\n"
    assert pointers(text) == []
