"""The bench suites' registry (bench/registry.py): a suite added there is a `--suite` choice, is
checked before any suite runs, runs in `--suite all` in registry order, and names its own flags
when it runs out of memory; `tools/gpu_suites_table.py` prints its report with its formatter."""

from __future__ import annotations

import json

import pytest

from tango_lm.bench import registry
from tango_lm.bench.registry import BENCH_SUITES, BenchSuite
from tango_lm.cli import main
from tango_lm.errors import UserError
from tests import helpers


def test_every_registered_suite_is_a_choice_and_has_its_parts():
    from tango_lm.cli import parse_args

    for name, suite in BENCH_SUITES.items():
        assert parse_args(["bench", "--suite", name]).suite == name
        assert callable(suite.run) and callable(suite.check) and callable(suite.format)
        assert suite.size_flags and all(flag.startswith("--") for flag in suite.size_flags)


def test_the_flags_a_suite_names_when_out_of_memory_are_options_of_the_command():
    # Kept as strings beside the options: a renamed option would leave the message naming a dead flag.
    from tango_lm.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    for name, suite in BENCH_SUITES.items():
        assert set(suite.size_flags) <= set(bench._option_string_actions), name


def test_a_suite_declares_its_own_options(monkeypatch):
    # They were all written into bench/suite.py: a new suite's option was an unrecognized argument.
    from tango_lm.cli import parse_args

    toy = BenchSuite(
        run=lambda args, print_table, progress: {},
        check=lambda args: None,
        format=str,
        size_flags=("--d-model",),
        add_arguments=lambda group: group.add_argument("--toy-rounds", type=int, default=2, help="toy rounds"),
    )
    monkeypatch.setitem(BENCH_SUITES, "toy", toy)
    assert parse_args(["bench", "--suite", "toy", "--toy-rounds", "5"]).toy_rounds == 5


def _fake_suites(monkeypatch, log: list[str], fail: dict[str, BaseException] | None = None) -> None:
    """Every registered suite replaced by one that logs its check and run and reports its name."""
    fail = fail or {}

    def fake(name: str) -> BenchSuite:
        def check(args):
            log.append(f"check {name}")
            if isinstance(fail.get(name), UserError):
                raise fail[name]

        def run(args, print_table, progress):
            log.append(f"run {name}")
            if isinstance(fail.get(name), MemoryError):
                raise fail[name]
            if print_table:
                print(f"table of {name}")
            return {"name": name}

        return BenchSuite(run, check, lambda report: f"table of {report['name']}", (f"--{name}-size", "--d-model"))

    for name in list(BENCH_SUITES):
        monkeypatch.setitem(registry.BENCH_SUITES, name, fake(name))


def test_suite_all_checks_every_suite_then_runs_them_in_registry_order(monkeypatch, capsys):
    log: list[str] = []
    _fake_suites(monkeypatch, log)
    assert main(["bench", "--suite", "all", "--quiet", "--json"]) == 0
    names = list(BENCH_SUITES)
    assert log == [f"check {n}" for n in names] + [f"run {n}" for n in names]
    report = json.loads(capsys.readouterr().out)
    assert report["suites"] == names and all(report[n] == {"name": n} for n in names)


def test_a_later_suites_bad_option_stops_before_any_suite_runs(monkeypatch, capsys):
    log: list[str] = []
    last = list(BENCH_SUITES)[-1]
    _fake_suites(monkeypatch, log, {last: UserError(f"--{last}-size must be at least 1")})
    assert main(["bench", "--suite", "all", "--quiet"]) == 2
    assert not any(line.startswith("run") for line in log)
    assert f"--{last}-size must be at least 1" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_a_suite_out_of_memory_names_its_own_size_flags_and_keeps_the_ones_before(monkeypatch, capsys):
    log: list[str] = []
    first, second, *_ = BENCH_SUITES
    _fake_suites(monkeypatch, log, {second: MemoryError()})
    assert main(["bench", "--suite", "all", "--quiet", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report[first] == {"name": first} and second not in report
    assert report["failed"]["suite"] == second
    assert (
        f"lower --{second}-size or --d-model; the report has the {first} suite before it" in report["failed"]["error"]
    )


@pytest.mark.parametrize("name", list(BENCH_SUITES))
def test_the_gpu_table_prints_each_suite_with_its_registered_formatter(monkeypatch, tmp_path, capsys, name):
    import sys

    monkeypatch.syspath_prepend(str(helpers.TOOLS))
    sys.modules.pop("gpu_suites_table", None)
    import gpu_suites_table

    log: list[str] = []
    _fake_suites(monkeypatch, log)
    (tmp_path / "s.rc").write_text("0")
    (tmp_path / "s.json").write_text(json.dumps({"suites": [name], name: {"name": name}}))
    gpu_suites_table.main(tmp_path)
    assert f"[s]\ntable of {name}" in capsys.readouterr().out
