"""Processes of a torchrun launch agree that their checks passed before any joins the process group.

Each process checks the run on its own before the process group forms (the launch, the run
directory, the data: train/run_dir.py, trainer.py), so a bad run stops without a rendezvous. On
one node torchrun stops the other processes when one exits with an error; across nodes it does
not, and the processes whose checks passed waited in `init_process_group` for the ones that had
stopped until its timeout (30 minutes), printing nothing. So every process posts the outcome of its
checks to torchrun's own store (its agent's TCPStore at MASTER_ADDR:MASTER_PORT, which serves the
workers from before they start) and one whose checks passed waits for every other's before it
joins: when one stopped, each of them stops too, with one line naming that process and its error.

Only where this process forms the group under torchrun's agent store, and not where torchrun may
restart processes (`--max-restarts`): its agents then disagree on the restart count (a restart for
a changed membership keeps it) and the store keeps an earlier attempt's votes, so a vote keyed by
it could wait for a key no process posts. A group the caller formed, a launch without torchrun's
agent, and one with restarts keep the checks that run inside the group.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from datetime import timedelta

import torch.distributed as dist

from tango_lm.errors import UserError

_calls = itertools.count()  # one vote per `train` call of a process (all processes make the same calls)
WAIT = timedelta(minutes=30)  # as init_process_group's own timeout: a slow process's checks (a large dataset's)
CONNECT = timedelta(seconds=10)  # a store gone (its agent stopped): a failed process says its error, not waits


class StartVote:
    """Post this process's outcome once: `passed()` (then wait for the others' and raise the first
    failure) or `failed(exc)`; both do nothing where no vote is held."""

    def __init__(self) -> None:
        from tango_lm.train.distributed import launch_env  # one error line for a malformed RANK/WORLD_SIZE

        self.rank, _, self.world_size = launch_env()
        self.held = (
            self.world_size > 1
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"
            and bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
            and not dist.is_initialized()
        )
        self.prefix = f"tango-lm/start-vote/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{next(_calls)}/"
        self.posted = False

    def _post(self, outcome: str) -> dist.Store:
        self.posted = True
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=CONNECT
        )
        store.set(f"{self.prefix}{self.rank}", outcome)
        return store

    def passed(self) -> None:
        """Post that this process's checks passed and wait for the others': UserError naming the
        first process that stopped, if one did."""
        if not self.held or self.posted:
            return
        store = self._post("")
        keys = [f"{self.prefix}{rank}" for rank in range(self.world_size)]
        store.wait(keys, WAIT)
        for rank, key in enumerate(keys):
            said = store.get(key).decode("utf-8", "replace")
            if said:
                raise UserError(f"process {rank} stopped before training: {said}")

    def failed(self, exc: BaseException) -> None:
        """Post that this process stopped, and why (its error's first line), for the others to say."""
        if not self.held or self.posted:
            return
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        said = text if isinstance(exc, UserError) else f"{type(exc).__name__}{': ' + text if text else ''}"
        with contextlib.suppress(Exception):  # a store out of reach: torchrun's own report is all there is
            self._post(said or type(exc).__name__)


__all__ = ["StartVote"]
