"""tools/gpu_suites.sh and tools/gpu_session.sh, with a stand-in for Python (as tests/test_tools.py
runs them): which suites run, what their table and exit code say, and the budget a session allows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

from tests import helpers

TOOLS = helpers.TOOLS


def test_gpu_suites_runs_a_suite_named_only_when_its_whole_name_is_given(tmp_path):
    # "train-70m-t4096" holds "train-70m": running that too would spend the budget on a suite not asked for
    proc = helpers.gpu_suites_process(tmp_path / "out", SUITES="train-70m-t4096")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.rc")) == ["train-70m-t4096.rc"]


def test_gpu_suites_into_a_reused_folder_reports_only_this_runs_suites(tmp_path):
    out = tmp_path / "out"
    assert helpers.gpu_suites_process(out, PYTHON="false", SUITES="windowed").returncode == 1
    proc = helpers.gpu_suites_process(out, SUITES="memory")  # the same OUT: the failed windowed suite is not this run's
    assert proc.returncode == 0, proc.stdout
    # the table has a row per .rc file (tools/gpu_suites_table.py)
    assert [p.name for p in out.glob("*.rc")] == ["memory.rc"]


def test_gpu_suites_gives_each_suite_its_own_seconds_and_what_is_left_of_the_budget(tmp_path):
    slow = tmp_path / "python"
    slow.write_text('#!/usr/bin/env bash\ncase "$*" in *"--suite train"*) sleep 2 ;; esac\necho "$@"\n')
    slow.chmod(0o755)
    out = tmp_path / "out"
    proc = helpers.gpu_suites_process(out, PYTHON=str(slow), SUITES="train-70m decode-small", BUDGET_S="200")
    assert proc.returncode == 0, proc.stderr
    logs = {name: (out / f"{name}.log").read_text() for name in ("train-70m", "decode-small")}
    took = {name: int(re.search(rf"^{name} rc=0 (\d+)s$", log, re.M)[1]) for name, log in logs.items()}
    assert took["train-70m"] >= 2 and took["decode-small"] <= 1, took  # not the seconds since the script began
    # the 2 s the train suite took are no longer the budget's: 200 - 45 - (2 or more)
    limit = int(re.match(r"== decode-small \(timeout (\d+)s\)", logs["decode-small"])[1])
    assert 100 < limit <= 153, limit


def test_gpu_suites_runs_the_160m_tier_at_its_sizes(tmp_path):
    out = tmp_path / "out"
    assert helpers.gpu_suites_process(out, SUITES="train-70m train-160m train-70m-t4096").returncode == 0
    sizes = {}
    for name in ("train-70m", "train-160m", "train-70m-t4096"):
        argv = (out / f"{name}.json").read_text().split()
        # the last of a repeated option is the one argparse keeps
        value = {
            flag: int(argv[len(argv) - 1 - argv[::-1].index(flag) + 1])
            for flag in ("--d-model", "--seq-len", "--batch-size", "--tango-width")
        }
        sizes[name] = value
    assert sizes["train-70m"] == {"--d-model": 512, "--seq-len": 1024, "--batch-size": 16, "--tango-width": 28480}
    assert sizes["train-160m"] == {"--d-model": 768, "--seq-len": 1024, "--batch-size": 16, "--tango-width": 52176}
    # T = 4096 at the same 16,384 tokens per step
    assert sizes["train-70m-t4096"] == {"--d-model": 512, "--seq-len": 4096, "--batch-size": 4, "--tango-width": 28480}


def test_gpu_suites_exits_1_when_its_table_fails(tmp_path):
    # every suite passed but no table was printed (a report it cannot read): not a pass
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\ncase "$*" in *gpu_suites_table.py*) exit 1 ;; esac\necho "$@"\n')
    fake.chmod(0o755)
    proc = helpers.gpu_suites_process(tmp_path / "out", PYTHON=str(fake), SUITES="memory")
    assert (tmp_path / "out" / "memory.rc").read_text().strip() == "0" and proc.returncode == 1


def _session(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(TOOLS / "gpu_session.sh"), "suites"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": "echo", "OUT": str(tmp_path), **env},
        timeout=60,
    )


def test_gpu_session_refuses_a_budget_past_540_seconds(tmp_path):
    # 541-600 s would leave the suites' table and the packing past the device tool's 10 minutes
    for budget in ("541", "600"):
        proc = _session(tmp_path, SUITES="memory", BUDGET_S=budget)
        assert proc.returncode == 2 and proc.stderr.startswith("error: BUDGET_S must be 120-540 seconds")
    assert _session(tmp_path, SUITES="memory", BUDGET_S="540").returncode == 0


def test_gpu_session_exits_as_the_part_did(tmp_path):
    # its exit code was tee's (0) whatever the suites did
    proc = _session(tmp_path, PYTHON="false", SUITES="windowed")
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1].endswith("(exit 1)")
    with tarfile.open(tmp_path / "suites.tar.gz") as archive:
        assert archive.extractfile("./session.txt").read().decode().splitlines()[-1] == "exit 1"


gpu_suites_table = helpers.tool("gpu_suites_table")


def _suite(out, name: str, rc: str, report: dict | None, mtime: int) -> None:
    (out / f"{name}.rc").write_text(f"{rc}\n")
    (out / f"{name}.log").write_text(f"== {name}\n{name} rc={rc} 7s\n")
    if report is not None:
        (out / f"{name}.json").write_text(json.dumps(report))
    os.utime(out / f"{name}.rc", (mtime, mtime))


def test_gpu_suites_table_statuses_in_the_order_the_suites_ran(tmp_path, capsys):
    stopped_first = {"suites": ["train"], "stopped": {"signal": "SIGTERM", "suite": "train"}, "failed": None}
    _suite(tmp_path, "train-70m", "0", None, 1000)  # exit 0 and no report: not a pass
    _suite(tmp_path, "train-160m", "137", None, 2000)  # SIGKILLed after timeout's grace
    _suite(tmp_path, "decode-small", "124", stopped_first, 3000)  # stopped before its first suite measured
    gpu_suites_table.main(tmp_path)
    rows = [line.split(None, 1) for line in capsys.readouterr().out.splitlines()[2:5]]
    assert [name for name, _ in rows] == ["train-70m", "train-160m", "decode-small"]  # as they ran, not by name
    status = {name: rest.rsplit(None, 1)[0].strip() for name, rest in rows}
    assert status == {
        "train-70m": "FAILED (no JSON report)",
        "train-160m": "KILLED",
        "decode-small": "TIMEOUT (partial: train)",
    }
