"""The README names everything a registry offers: adding an architecture, head, data source,
bench suite or logger is one file and its registry entry (README "Layout"), and the README's
lists are the one place a reader learns the names from."""

from __future__ import annotations

import re

import pytest

from tango_lm.bench.registry import BENCH_SUITES
from tango_lm.data.sources import SOURCES
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.train.loggers import LOGGERS
from tests import helpers

README = (helpers.ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(title)}\n", README, re.M)
    assert match, title
    level = len(match.group(1))
    rest = README[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start() if end else len(rest)]


@pytest.mark.parametrize(
    ("registry", "title", "pattern"),
    [
        (ARCHITECTURES, "What is in it", "`{}`"),
        (HEADS, "What is in it", "`{}`"),
        (SOURCES, "Data", "data prepare {} "),
        (BENCH_SUITES, "Benchmark", "--suite {} "),
        (LOGGERS, "What a run writes", "`{}`"),  # `[jsonl]` too: a name alone in backticks or a list
    ],
    ids=["architectures", "heads", "data sources", "bench suites", "loggers"],
)
def test_the_readme_names_every_registered_name(registry, title, pattern):
    text = section(title).replace("`[", "`").replace("]`", "`")
    missing = [name for name in registry if pattern.format(name) not in text]
    assert not missing, f"README section {title!r} does not name {missing}"
