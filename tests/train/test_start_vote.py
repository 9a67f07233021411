"""Processes of a torchrun launch agree that their checks passed before joining the process group
(train/start_vote.py): across nodes, where torchrun does not stop the other processes when one
exits, a process whose checks failed stopped alone and the others waited in the rendezvous for 30
minutes, printing nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tango_lm.errors import UserError
from tango_lm.train.start_vote import StartVote
from tests import helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent_store(monkeypatch):
    """torchrun's agent store for a launch of 3 processes, as its workers' environment names it."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3"}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return store


def _votes(monkeypatch) -> list[StartVote]:
    votes = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        votes.append(StartVote())
    return votes


def test_processes_whose_checks_passed_stop_with_the_error_of_one_that_did_not(agent_store, monkeypatch):
    votes = _votes(monkeypatch)
    assert all(v.held for v in votes) and len({v.prefix for v in votes}) == 3  # one vote per call
    for v in votes[1:]:
        v.prefix = votes[0].prefix  # the three processes' first call
    outcomes: dict[int, BaseException | None] = {}

    def passing(rank: int) -> None:
        try:
            votes[rank].passed()
            outcomes[rank] = None
        except UserError as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=passing, args=(rank,)) for rank in (0, 2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert not outcomes  # waiting for process 1
    votes[1].failed(UserError("no prepared dataset at data (directory missing)\nsecond line"))
    for t in threads:
        t.join(timeout=20)
    assert {rank: str(exc) for rank, exc in outcomes.items()} == {
        rank: "process 1 stopped before training: no prepared dataset at data (directory missing)" for rank in (0, 2)
    }


def test_all_passed_joins_and_a_second_outcome_is_not_posted(agent_store, monkeypatch):
    votes = _votes(monkeypatch)
    for v in votes[1:]:
        v.prefix = votes[0].prefix
    threads = [threading.Thread(target=v.passed) for v in votes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    votes[1].failed(RuntimeError("later"))  # an error after the group formed: the vote was cast
    assert agent_store.get(votes[0].prefix + "1") == b""


def test_no_vote_without_torchruns_agent_store_or_where_it_may_restart_processes(agent_store, monkeypatch):
    # With --max-restarts the agents disagree on the restart count and the store keeps an earlier
    # attempt's votes: a process could wait for a key no process posts.
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert not StartVote().held
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert StartVote().held
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    vote = StartVote()
    assert not vote.held
    vote.passed()  # returns at once: nothing to wait for
    vote.failed(UserError("x"))


def test_a_malformed_launch_is_one_error_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(UserError, match="RANK, LOCAL_RANK and WORLD_SIZE must be integers"):
        StartVote()


def test_a_failed_process_whose_store_is_gone_says_its_error_at_once(agent_store, monkeypatch):
    # The store's agent stopped (its node's processes all failed): the vote waited 30 minutes to
    # connect before the process printed its own error.
    from tango_lm.train import start_vote

    monkeypatch.setattr(start_vote, "CONNECT", timedelta(seconds=1))
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing listens there
    vote = StartVote()
    t0 = time.monotonic()
    vote.failed(UserError("no prepared dataset"))
    assert time.monotonic() - t0 < 15 and vote.posted


@pytest.mark.usefixtures("one_thread")
def test_two_nodes_one_without_the_data_both_stop_at_once_with_one_line(data_dir, tmp_path):
    # Two torchrun agents (one node each) on this machine: node b's relative data.dir is missing.
    port = _free_port()
    nodes = {name: tmp_path / name for name in ("a", "b")}
    for path in nodes.values():
        path.mkdir()
    (nodes["a"] / "data").symlink_to(data_dir, target_is_directory=True)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "vote",
        "--log-dir",  # relative: each node's own cwd, not a /tmp/torchelastic_* left behind
        "torchrun-logs",
        "-m",
        "tango_lm.cli",
        "train",
        *helpers.cli_overrides(data_dir, tmp_path / "shared" / "run", parallel="ddp", batch_size=2),
        "data.dir=data",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {
        name: subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cwd in nodes.items()
    }
    errors = {}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=120)  # before: node a waited in the rendezvous for 30 minutes
            errors[name] = [line for line in err.splitlines() if line.startswith("error: ")]
    finally:
        for proc in procs.values():
            proc.kill()
    assert all(proc.returncode != 0 for proc in procs.values())
    missing = "no prepared dataset at data (directory missing)"
    assert len(errors["b"]) == 1 and errors["b"][0].startswith(f"error: {missing}"), errors
    assert len(errors["a"]) == 1 and errors["a"][0].startswith("error: process "), errors
    assert f"stopped before training: {missing}" in errors["a"][0]
    assert not (tmp_path / "shared").exists()


@pytest.fixture
def agent_store_of_two(monkeypatch):
    """torchrun's agent store for a launch of 2 processes, as its workers' environment names it."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    return store


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), UserError(""), RuntimeError("   ")])
def test_a_failure_without_a_message_stops_the_others(agent_store_of_two, monkeypatch, exc):
    # An error whose first line is empty must not post "", the outcome that means "passed": the
    # other process would go on to wait in init_process_group for one that had stopped.
    votes = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        votes.append(StartVote())
    votes[1].prefix = votes[0].prefix  # the two processes' first call
    outcome: dict[str, BaseException | None] = {}

    def passing() -> None:
        try:
            votes[0].passed()
            outcome["0"] = None
        except UserError as err:
            outcome["0"] = err

    thread = threading.Thread(target=passing)
    thread.start()
    votes[1].failed(exc)
    thread.join(timeout=20)
    assert str(outcome["0"]) == f"process 1 stopped before training: {type(exc).__name__}"
