"""One writer per output directory (output_lock.py, train/run_dir.py): two trains or two data
prepares on one directory (the second refused at once, naming the holder; the first whole), a
lock released when its holder is killed, run files of any kind refused without --resume, and
runs and datasets kept out of each other."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.data.shards import PreparedDataset
from tango_lm.errors import UserError
from tango_lm.output_lock import OutputLocked, hold_output_lock, lock_file_for
from tango_lm.sweep import load_grid, run_sweep
from tango_lm.train.run_dir import RUN_FILES, claim_run_dir
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = {"steps": 6, "save_every": 3, "eval_every": 3}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


@contextlib.contextmanager
def held_by_other(lock: Path, pid: int = 4242) -> Iterator[None]:
    """Hold `lock` as another process would: a separate open file with the holder's note."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write(
            json.dumps({"pid": pid, "host": "node7", "command": "tango-lm train", "started": "2031-01-02 03:04:05"})
        )
        f.flush()
        yield


def refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return helpers.assert_one_error_line(captured.err)


@contextlib.contextmanager
def stopped_holder(argv: list[str], lock: Path) -> Iterator[subprocess.Popen]:
    """Start `python -m tango_lm.cli ARGV`, wait until it holds `lock`, and keep it stopped (SIGSTOP)
    for the body of the block, so another writer surely meets the lock; then let it finish."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tango_lm.cli", *argv],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(lock.read_text())["pid"] == proc.pid:
                    break
            time.sleep(0.005)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        if sys.exc_info()[0] is not None:
            proc.kill()
    proc.wait(timeout=120)


# -- the lock ---------------------------------------------------------------------------------
def test_lock_names_its_holder_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    with held_by_other(lock_file_for(out)):
        with pytest.raises(OutputLocked) as err, hold_output_lock(out, "tango-lm train", "pick another"):
            pass
    assert "in use by tango-lm train (pid 4242 on host node7, started 2031-01-02 03:04:05)" in str(err.value)
    assert str(err.value).endswith("wait for it to finish or pick another")

    target = tmp_path / "x" / "y"
    with hold_output_lock(target, "tango-lm train", "pick another") as lock:
        note = json.loads(lock.read_text())
        assert note["pid"] == os.getpid() and note["host"] == socket.gethostname()
        with hold_output_lock(target, "tango-lm train", "pick another"):  # the holder may take it again
            pass
        assert lock.exists()
    assert not (tmp_path / "x").exists()  # lock file and the directories made for it are gone


def test_a_killed_holder_releases_the_lock(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    code = (
        "import fcntl, json, os, time\n"  # takes the lock as output_lock does, without importing torch
        f"f = open({str(lock_file_for(out))!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "f.write(json.dumps({'pid': os.getpid(), 'host': 'h', 'command': 'c', 'started': 's'})); f.flush()\n"
        "print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OutputLocked, match=f"pid {proc.pid} "), hold_output_lock(out, "tango-lm train", "x"):
            pass
    finally:
        proc.kill()
        proc.wait()
    assert lock_file_for(out).exists()  # a SIGKILL leaves the file, not the lock
    with hold_output_lock(out, "tango-lm train", "x"):
        pass


def test_only_rank_0_takes_the_run_lock(data_dir, tmp_path):
    run = helpers.run_config(data_dir, tmp_path / "run")
    with held_by_other(lock_file_for(tmp_path / "run")):
        with claim_run_dir(run, resume=False, main_process=False):  # other ranks write nothing
            pass
        with pytest.raises(OutputLocked), claim_run_dir(run, resume=False, main_process=True):
            pass


# -- train ------------------------------------------------------------------------------------
def test_two_trains_on_one_directory(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *helpers.cli_overrides(data_dir, out, **TRAIN), "--json"]
    with stopped_holder(argv, lock_file_for(out)) as first:
        line = refused(capsys, argv)
        assert f"{out} is in use by tango-lm train (pid {first.pid} on host {socket.gethostname()}, started " in line
        assert "set train.out_dir to another directory" in line
        assert refused(capsys, [*argv, "--resume"]) == line  # --resume waits its turn too
    assert first.returncode == 0, first.stderr.read()
    assert [r["step"] for r in helpers.loss_records(out)] == [1, 2, 3, 4, 5, 6]
    summaries = [r for r in helpers.read_metrics(out) if r.get("event") == "summary"]
    assert (
        len(summaries) == 1 and summaries[0]["test_nll"] == json.loads((out / "summary.json").read_text())["test_nll"]
    )
    assert not lock_file_for(out).exists()


@pytest.mark.parametrize("name", RUN_FILES)
def test_any_run_file_means_the_directory_holds_a_run(data_dir, tmp_path, capsys, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if name == "checkpoints" else (out / name).write_text("{}")
    before = helpers.snapshot(out)
    line = refused(capsys, ["train", *helpers.cli_overrides(data_dir, out, **TRAIN)])
    assert f"already holds a run ({name})" in line and "--resume" in line
    assert helpers.snapshot(out) == before


def test_runs_and_datasets_stay_out_of_each_other(data_dir, tmp_path, capsys):
    before = helpers.snapshot(data_dir)
    inside = data_dir / "runs" / "x"
    line = refused(capsys, ["train", *helpers.cli_overrides(data_dir, inside, **TRAIN)])
    assert f"is inside the prepared dataset {data_dir}" in line
    assert helpers.snapshot(data_dir) == before

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(helpers.run_config(data_dir, run).to_dict()))
    (tmp_path / "doc.txt").write_text("some text\n")
    argv = ["data", "prepare", "text", str(tmp_path / "doc.txt"), "--tokenizer", "byte", "--no-progress"]
    line = refused(capsys, [*argv, "--out", str(run / "data")])
    assert f"is inside the run directory {run}" in line
    # nor a run inside a run, or a sweep in one (it once wrote its runs and status.json there)
    line = refused(capsys, ["train", *helpers.cli_overrides(data_dir, run / "deeper" / "x", **TRAIN)])
    assert f"train.out_dir {run / 'deeper' / 'x'} is inside the run directory {run}" in line
    for out_dir, where in ((run, "is"), (run / "sweep", "is inside")):
        grid = tmp_path / "grid.yaml"
        grid.write_text(
            f"out_dir: {out_dir}\nbase: {{train: {{steps: 1}}}}\naxes: {{arch: [tango], data.dir: [{data_dir}]}}\n"
        )
        line = refused(capsys, ["sweep", str(grid)])
        assert f"out_dir {out_dir} {where} the run directory {run}; choose a directory outside it" in line
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]
    (tmp_path / "config.json").write_text("{}")  # a stray config.json does not make a folder a run
    assert main([*argv, "--out", str(tmp_path / "data")]) == 0
    before = helpers.snapshot(data_dir)  # a dataset inside another: replacing the outer one removes it
    line = refused(capsys, [*argv, "--out", str(data_dir / "nested")])
    assert f"is inside the prepared dataset {data_dir}" in line
    assert helpers.snapshot(data_dir) == before


# -- data prepare -----------------------------------------------------------------------------
def test_two_prepares_into_one_directory(tmp_path, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"document number {i} " * 20 for i in range(400)))
    out = tmp_path / "data"
    argv = [
        "data",
        "prepare",
        "text",
        str(docs),
        "--out",
        str(out),
        "--tokenizer",
        "byte",
        "--split-on-blank-lines",
        "--no-progress",
    ]
    with stopped_holder(argv, lock_file_for(out, beside=True)) as first:
        line = refused(capsys, [*argv, "--overwrite"])
        assert f"{out} is in use by tango-lm data prepare (pid {first.pid} on host " in line
        assert not out.exists()
    assert first.returncode == 0, first.stderr.read()
    ds = PreparedDataset.open(out, verify=True)
    assert sum(ds.num_documents(s) for s in ds.splits) == 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "docs.txt"]  # no lock, no leftovers


# -- sweep ------------------------------------------------------------------------------------
def test_sweep_leaves_a_run_another_process_trains(data_dir, tmp_path):
    import yaml

    base = {
        "model": {k: v for k, v in helpers.TINY_MODEL.items() if k != "arch"},
        "train": {**helpers.TINY_TRAIN, "steps": 2, "eval_every": 2, "save_every": 2},
    }
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        yaml.safe_dump(
            {
                "out_dir": str(tmp_path / "sweep"),
                "base": base,
                "axes": {"dataset": {"syn": str(data_dir)}, "arch": ["tango"], "seed": [[17, 101], [23, 103]]},
            }
        )
    )
    busy, free = (r.out_dir for r in load_grid(grid).runs)
    with held_by_other(lock_file_for(busy)):
        rows = run_sweep(load_grid(grid), progress=False, log=lambda _: None)
        assert sorted(p.name for p in busy.iterdir()) == [".lock"]  # nothing written beside the holder
    assert [r["status"] for r in rows] == ["failed", "trained"]
    assert "is in use by tango-lm train (pid 4242" in rows[0]["error"]
    assert (free / "summary.json").exists()


def test_a_holder_that_has_not_written_its_note_yet_is_named_as_just_started(tmp_path):
    # Between its flock and its note the holder's file is empty: the refusal was a JSONDecodeError traceback.
    out = tmp_path / "run"
    out.mkdir()
    with open(lock_file_for(out), "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(OutputLocked) as err, hold_output_lock(out, "tango-lm train", "pick another"):
            pass
    assert "in use by another tango-lm process (it has only just started)" in str(err.value)


def test_a_file_system_without_locks_is_refused_and_leaves_no_directories(tmp_path, monkeypatch):
    # NFS mounted without lock support: the refusal is one line, and the folders made to hold the
    # lock file go with it ("a command refused after taking the lock leaves nothing behind").
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(UserError, match="the file system does not support file locks, pick another$"):
        with hold_output_lock(out, "tango-lm train", "pick another"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_the_note_replaces_a_killed_holders_longer_one(tmp_path):
    # A SIGKILL leaves the lock file and its note; the next holder's shorter note written over it
    # left the old tail, and a refused writer read "another process" instead of the holder.
    out = tmp_path / "run"
    out.mkdir()
    note = {"pid": 1, "host": "a-much-longer-host-name" * 8, "command": "tango-lm data prepare", "started": "s"}
    lock_file_for(out).write_text(json.dumps(note) + "\n")
    with hold_output_lock(out, "tango-lm train", "pick another") as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
