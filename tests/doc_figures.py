"""The figures the docs quote, read from the docs themselves, for the tests that plan them: a doc
cannot drift from the code without a test failing. test_estimate holds README.md's, docs/models.md's,
docs/architecture.md's and docs/estimate.md's planner figures to fresh plans, test_moe the
Qwen3-30B-A3B ones (docs/estimate.md, docs/moe.md)."""

from __future__ import annotations

import re

from tests.helpers import ROOT

GIB = 2**30


def text(document: str) -> str:
    """The document, its line breaks and indentation inside paragraphs folded to single spaces."""
    return re.sub(r"\s*\n\s*", " ", (ROOT / document).read_text())


def figure(document: str, pattern: str) -> list[str]:
    """The groups of `pattern` (a regex, matched once in the folded text) in `document`."""
    match = re.search(pattern, text(document))
    assert match, f"{document}: no {pattern!r}"
    return list(match.groups())


def gib(value: int, digits: int = 2) -> str:
    """Bytes as the planner prints them: GiB with `digits` decimals."""
    return f"{value / GIB:.{digits}f}"


def printed_block(document: str, command: str) -> list[str]:
    """The lines of the first code block after `command` (a planner command as the doc writes it),
    without the lines that stand for output left out (`...`, `(then ...)`) and without the header's
    planning time, which is the machine's."""
    source = (ROOT / document).read_text()
    start = source.index(command)
    block = re.search(r"```\n(.*?)```", source[start:], flags=re.S)
    assert block, f"{document}: no printed plan after {command!r}"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    return [drop_time(line) for line in lines if line.strip() != "..." and not line.startswith("(then ")]


def drop_time(line: str) -> str:
    return re.sub(r" \| planned in \d+ s$", "", line)


def assert_printed(document: str, command: str, table: str) -> None:
    """Every line of the doc's printed plan after `command` is a line of the planner's `table`."""
    printed = {drop_time(line) for line in table.splitlines()}
    lines = printed_block(document, command)
    assert len(lines) > 5, lines
    for line in lines:
        assert line in printed, f"{document}: {line!r} is not what the planner prints now:\n{table}"


def rounds_to(written: str, value: float) -> bool:
    """Whether `written` (a decimal as a doc writes it) is `value` rounded to its digits."""
    decimals = len(written.partition(".")[2])
    return abs(float(written) - value) <= 0.5 * 10**-decimals + 1e-9
