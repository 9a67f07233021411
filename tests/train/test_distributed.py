"""Data-parallel training under torchrun with 2 gloo ranks on CPU (train/distributed.py): DDP and
FSDP2 (also under torch.compile) match one process on the same global batch, checkpoints move between process counts in both
directions and formats, and bad launches fail with one line and exit code 2.

One `torchrun --nproc-per-node 2` launch trains every 2-rank run of this module in sequence (each
2-rank start costs seconds of imports on a small CI box); the single-process references and
resumes run in the test process.

Tolerance: the 2-rank losses, gradient norms, dev/test NLL and final weights equal one process's
up to float32 summation order (gradient all-reduce, per-rank loss means). Measured on these runs:
losses within 2e-7 relative, gradient norms within 4e-7, test NLL within 6e-8, weights after 12
AdamW steps within 3e-6 absolute (Adam's normalised step magnifies last-bit gradient differences).
The tests allow rtol 1e-5 on losses and NLL, 1e-4 on gradient norms, and rtol 1e-4 + atol 1e-5 on
weights (lr 3e-3: a hundredth of one step)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tango_lm.cli import main
from tango_lm.eval.evaluate import evaluate_checkpoint
from tango_lm.train.checkpoint import load_checkpoint
from tango_lm.train.trainer import Trainer, train
from tests import helpers

LOSS_RTOL = 1e-5
UNTIED = {"arch": "untied-transformer"}  # every block applied once: FSDP shards block by block
AW = {"active_width": 12}  # rotating narrow width: 3 segments of the 32 columns per head
ACCUM = {"batch_size": 4, "grad_accum": 2}  # global batch 8 windows: 2 per rank per micro-batch
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the ddp run also logs to it (rank 0 only)

# name -> (model overrides, train overrides, scripted dev NLL) of the 2-rank runs (12 steps, saves
# at 4, 8, 12). A scripted dev NLL makes step 8 the best, so the test NLL comes from the step-8
# checkpoint, read back into the sharded model at the end of the run.
RUNS = {
    "ddp": ({}, {**ACCUM, "parallel": "ddp", "loggers": "jsonl,tensorboard" if TENSORBOARD else "jsonl"}, False),
    "ddp_aw": (AW, {"parallel": "ddp"}, False),
    # The onóna validation protocol: 5 of the 9 dev windows sampled with a seed, in batches of 3.
    "ddp_sampled": ({}, {"parallel": "ddp", "eval_sample_seed": 1234, "eval_windows": 5, "eval_batch_size": 3}, False),
    "fsdp": (UNTIED, {"parallel": "fsdp"}, True),
    "sharded": ({}, {**ACCUM, "parallel": "fsdp", "checkpoint_format": "sharded"}, True),
    # torch.compile on each rank over FSDP2 shards; its reference is the eager single process.
    "fsdp_compile": (UNTIED, {"parallel": "fsdp", "compile": True}, True),
    # AttnRes's layers return no tensors (they write into the depth sources): they stay in the root unit.
    "fsdp_attnres": ({"arch": "attnres", "n_kv_heads": 2}, {"parallel": "fsdp"}, False),
}
# The 1 -> 2 direction: a single-process run cut at step 8, finished by 2 FSDP ranks.
ONE_TO_TWO = ({}, {**ACCUM, "parallel": "fsdp", "checkpoint_format": "sharded"}, False)
# A NaN loss on rank 1 alone at steps 1 and 3 (train/nonfinite.py): both FSDP ranks skip those
# updates, as one process whose loss is NaN there does; the step-1 save, before any update, gathers
# an optimizer state that does not exist yet (which made AdamW count a step never taken).
NAN_ON_RANK_1 = (UNTIED, {"parallel": "fsdp", "save_every": 1, "keep_last": 1}, [1, 3])
DEV_SCRIPT = {4: 3.0, 8: 2.0, 12: 2.5}
# The whole module takes 20-35 s on 2 cores, 55-85 s beside other compiling tests. The ranks print
# their stacks 20 s before this timeout, so that a hang says where it is (one was seen, once in twenty-six
# runs: in fsdp_compile, under torch 2.11, beside the Triton and compile tests; torchrun's output
# showed only that it had begun).
TORCHRUN_TIMEOUT_S = 240

# Runs each job's `tango-lm train` in turn inside one process group (formed here, so the trainer
# joins it rather than forming and tearing down one per run over torchrun's shared store).
DRIVER = """
import faulthandler, json, os, sys
faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]))  # where a rank hangs, before the test's timeout
import torch.distributed as dist
from tango_lm.cli import main
from tango_lm.train.trainer import Trainer
dist.init_process_group("gloo")
jobs = json.loads(open(sys.argv[1]).read())
real_dev, codes = Trainer.evaluate_dev, {}
real_init = Trainer.__init__
def init(self, *args, **kwargs):  # record the dev windows each rank scores, in order
    real_init(self, *args, **kwargs)
    path = os.path.join(os.path.dirname(sys.argv[1]), f"{name}.dev-rank{os.environ['RANK']}.json")
    open(path, "w").write(json.dumps([x.tolist() for x, _ in self.dev_batches]))
    if len(jobs[name]) > 2 and os.environ["RANK"] == "1":  # a NaN loss at these steps, on rank 1 only
        forward, trainer = self.step_fn, self
        self.step_fn = lambda x, y: forward(x, y) * (float("nan") if trainer.step + 1 in jobs[name][2] else 1.0)
Trainer.__init__ = init
import tango_lm.train.trainer_checkpoints as trainer_module  # where save() finds it
from tango_lm.train.checkpoint import write_failed
real_finish = trainer_module.finish_checkpoint
def full_disk(tmp, step, *args):  # rank 0 alone writes the files: as on a full disk
    raise write_failed(tmp.parent, step, OSError(28, "No space left on device"))
import time
import tango_lm.train.run_dir as run_dir
real_check = run_dir._check_contents
def late_check(out, resume, *args, **kwargs):  # rank 1 checks the FSDP run's directory late: rank 0 must not have written yet
    if name == "fsdp" and os.environ["RANK"] == "1":
        time.sleep(1)
    real_check(out, resume, *args, **kwargs)
run_dir._check_contents = late_check
import tango_lm.train.trainer as trainer_py  # where Trainer finds them
from tango_lm.errors import UserError
real_open, real_steps = trainer_py.open_loggers, trainer_py.complete_steps
def loggers_fail(*args):  # rank 0 alone opens the loggers: as W&B without an API key
    raise UserError("W&B could not start: no API key")
def steps_elsewhere(root):  # rank 1's out_dir is not on the disk rank 0 saved to
    return [] if os.environ["RANK"] == "1" else real_steps(root)
for name, (argv, script, *_) in jobs.items():
    Trainer.evaluate_dev = (lambda self: script[str(self.step)]) if script else real_dev
    trainer_module.finish_checkpoint = full_disk if name == "save_fails" else real_finish
    trainer_py.open_loggers = loggers_fail if name == "loggers_fail" else real_open
    trainer_py.complete_steps = steps_elsewhere if name == "resume_elsewhere" else real_steps
    codes[name] = main(argv)
open(sys.argv[2] + f".rank{os.environ['RANK']}", "w").write(json.dumps(codes))
dist.destroy_process_group()
"""


pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(data_dir: Path, out: Path, model: dict, train_kw: dict) -> list[str]:
    return [*helpers.cli_overrides(data_dir, out, **train_kw), *(f"model.{k}={v}" for k, v in model.items())]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in helpers.loss_records(run_dir)}


def _cut_at_8(src: Path, dst: Path) -> Path:
    """A copy of a finished 12-step run as if it had been killed right after its step-8 save."""
    shutil.copytree(src, dst)
    shutil.rmtree(helpers.step_dir(dst, 12))
    return dst


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Single-process references, then one torchrun launch training every 2-rank run."""
    root = tmp_path_factory.mktemp("dist")
    refs, done = {}, {}
    for name, (model, train_kw, scripted) in {**RUNS, "one_to_two": ONE_TO_TWO}.items():
        single = {k: v for k, v in train_kw.items() if k not in ("parallel", "checkpoint_format", "compile")}
        key = json.dumps([model, single, scripted], sort_keys=True)
        if key not in done:  # runs that differ only in parallelism share their reference
            with pytest.MonkeyPatch.context() as m:
                if scripted:
                    m.setattr(Trainer, "evaluate_dev", lambda self: DEV_SCRIPT[self.step])
                done[key] = train(helpers.run_config(data_dir, root / f"{name}-ref", model, **single)), name
        refs[name], ref_name = done[key]
        if ref_name != name:
            (root / f"{name}-ref").symlink_to(root / f"{ref_name}-ref")
    jobs = {
        name: [
            ["train", *_overrides(data_dir, root / name, model, train_kw), "--no-progress"],
            DEV_SCRIPT if scripted else None,
        ]
        for name, (model, train_kw, scripted) in RUNS.items()
    }
    cut = _cut_at_8(root / "one_to_two-ref", root / "one_to_two")
    model, train_kw, _ = ONE_TO_TWO
    jobs["one_to_two"] = [["train", *_overrides(data_dir, cut, model, train_kw), "--resume", "--no-progress"], None]
    model, train_kw, nan_steps = NAN_ON_RANK_1
    with pytest.MonkeyPatch.context() as m:
        real = Trainer.train_step

        def nan_loss(self):
            forward = self.step_fn
            self.step_fn = lambda x, y: forward(x, y) * (float("nan") if self.step + 1 in nan_steps else 1.0)
            try:
                return real(self)
            finally:
                self.step_fn = forward

        m.setattr(Trainer, "train_step", nan_loss)
        refs["nan"] = train(helpers.run_config(data_dir, root / "nan-ref", model))
    jobs["nan"] = [["train", *_overrides(data_dir, root / "nan", model, train_kw), "--no-progress"], None, nan_steps]
    # Rank 0 cannot open its loggers: both ranks stop with one line (rank 1 would wait at a collective).
    jobs["loggers_fail"] = [
        ["train", *_overrides(data_dir, root / "loggers_fail", {}, {"parallel": "ddp"}), "--no-progress"],
        None,
    ]
    # Rank 1 finds no checkpoint where rank 0 resumes from step 8: both refuse before training.
    elsewhere = _cut_at_8(root / "ddp_aw-ref", root / "resume_elsewhere")
    jobs["resume_elsewhere"] = [
        ["train", *_overrides(data_dir, elsewhere, AW, {"parallel": "ddp"}), "--resume", "--no-progress"],
        None,
    ]
    # Last: rank 0's checkpoint write fails; both ranks stop with one line (rank 1 broke at a barrier).
    jobs["save_fails"] = [
        ["train", *_overrides(data_dir, root / "save_fails", {}, {"parallel": "ddp"}), "--no-progress"],
        None,
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "driver.py").write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STACKS_AFTER_S": str(TORCHRUN_TIMEOUT_S - 20)}
    # torchrun (--standalone picks a free port)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",  # its per-run folder, else one /tmp/torchelastic_* is left behind each launch
            str(root / "torchrun-logs"),
            str(root / "driver.py"),
            str(root / "jobs.json"),
            str(root / "codes.json"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on, and kills a rank still there 30 s later
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        stacks = err.find("Timeout (")  # faulthandler's heading
        pytest.fail(f"torchrun timed out: {err[stacks:][:12000] if stacks >= 0 else err[-12000:]}")
    assert proc.returncode == 0, err[-4000:]
    (root / "torchrun.err").write_text(err)
    want = {**dict.fromkeys(jobs, 0), "save_fails": 2, "loggers_fail": 2, "resume_elsewhere": 2}
    for rank in (0, 1):
        assert json.loads((root / f"codes.json.rank{rank}").read_text()) == want, rank
    assert "error: rank 0 could not write checkpoint step-00000004" in err and "Connection closed" not in err
    return root, refs


# -- 2 ranks vs 1 process ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_match_one_process(runs, name):
    root, refs = runs
    ref, out = refs[name], root / name
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 13))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref.losses[step], rel=LOSS_RTOL), step
    ref_records, records = helpers.loss_records(root / f"{name}-ref"), helpers.loss_records(out)
    assert [r["tokens"] for r in records] == [r["tokens"] for r in ref_records]  # the global batch
    assert [r["lr"] for r in records] == [r["lr"] for r in ref_records]
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ref_records], rel=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("best_dev_nll", "test_nll"):
        assert summary[key] == pytest.approx(ref.summary[key], rel=LOSS_RTOL), key
    for key in ("steps", "tokens", "selected_step", "test_tokens"):
        assert summary[key] == ref.summary[key], key
    assert summary["selected_step"] == (8 if RUNS[name][2] else 12)
    # The final weights, read back through the checkpoint API (full or sharded alike).
    a = load_checkpoint(helpers.step_dir(root / f"{name}-ref", 12)).model_state()
    b = load_checkpoint(helpers.step_dir(out, 12)).model_state()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


def test_a_nan_on_one_rank_skips_the_update_on_every_rank(runs):
    root, refs = runs
    records, ref_records = helpers.loss_records(root / "nan"), helpers.loss_records(root / "nan-ref")
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped == [r["step"] for r in ref_records if r.get("skipped")] == [1, 3]
    assert records[2]["loss"] is None and records[2]["grad_norm"] is None
    for step, loss in _losses(root / "nan").items():
        if step not in skipped:
            assert loss == pytest.approx(refs["nan"].losses[step], rel=LOSS_RTOL), step
    a = load_checkpoint(helpers.step_dir(root / "nan-ref", 12)).model_state()
    b = load_checkpoint(helpers.step_dir(root / "nan", 12)).model_state()
    for k in a:  # had the ranks disagreed, their shards would have moved apart from here on
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    assert json.loads((root / "nan" / "summary.json").read_text())["skipped_steps"] == 2


def test_sampled_dev_windows_are_the_same_on_every_rank_and_process_count(runs, data_dir, tmp_path):
    root, _ = runs
    model, train_kw, _ = RUNS["ddp_sampled"]
    single = {k: v for k, v in train_kw.items() if k != "parallel"}
    one = [x.tolist() for x, _ in Trainer(helpers.run_config(data_dir, tmp_path / "one", model, **single)).dev_batches]
    ranks = [json.loads((root / f"ddp_sampled.dev-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == one and [len(b) for b in one] == [3, 2]
    unsampled = json.loads((root / "ddp.dev-rank0.json").read_text())
    assert [row for b in one for row in b] != [row for b in unsampled for row in b][:5]
    # and the dev NLL the 2 ranks logged is one process's (test_two_ranks_match_one_process: best_dev_nll)


def test_rank_zero_alone_logs_and_writes(runs):
    root, _ = runs
    for name in RUNS:
        out = root / name
        assert [r["step"] for r in helpers.loss_records(out)] == list(range(1, 13))  # once, not per rank
        assert len([r for r in helpers.read_metrics(out) if r.get("event") == "summary"]) == 1
        assert helpers.step_names(out) == ["step-00000008", "step-00000012"]
        assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-"))]
        meta = load_checkpoint(helpers.step_dir(out, 12)).meta
        assert (meta["parallel"], meta["world_size"]) == (RUNS[name][1]["parallel"], 2)
        assert json.loads((out / "best.json").read_text())["step"] == (8 if RUNS[name][2] else 12)
    if not TENSORBOARD:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (root / "ddp" / "tensorboard").glob("events.out.tfevents.*")  # one file: rank 0's
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/loss")] == list(range(1, 13))


def test_rank_zero_failing_to_start_stops_every_rank_in_one_line(runs):
    """Rank 0 alone opens the loggers and writes the run's files; its failure reaches rank 1, which
    would otherwise wait at the first collective and die there with gloo's traceback."""
    root, _ = runs
    err = (root / "torchrun.err").read_text()
    assert "error: W&B could not start: no API key" in err
    assert "error: rank 0 could not start the run; its error says why" in err
    assert not (root / "loggers_fail" / "metrics.jsonl").exists()


def test_processes_resuming_from_different_checkpoints_are_refused(runs):
    root, _ = runs
    err = (root / "torchrun.err").read_text()
    want = "(process 0: step 8, process 1: step 0); put train.out_dir on a disk every process shares"
    assert err.count(want) == 2  # each rank says it, before either trains
    # untouched: the killed run's records past its checkpoint are still there for the real resume
    assert (root / "resume_elsewhere" / "metrics.jsonl").read_text() == (
        root / "ddp_aw-ref" / "metrics.jsonl"
    ).read_text()
    assert helpers.step_names(root / "resume_elsewhere") == ["step-00000008"]


# Rank 1 leaves the group; rank 0's next collective fails as when a process dies mid-run.
PEER_GONE = """
import os, torch, torch.distributed as dist
from tango_lm.train.distributed import lost_contact
dist.init_process_group("gloo")
dist.barrier()
if os.environ["RANK"] == "1":
    os._exit(0)
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as exc:
    print("lost contact" if lost_contact(exc) else f"not recognised: {exc}")
"""


def test_a_collective_whose_peer_died_is_recognised(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "peer_gone.py").write_text(PEER_GONE)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "peer_gone.py")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert out.strip() == "lost contact", err[-2000:]


def test_a_rank_that_lost_its_peers_says_so_in_one_line(data_dir, tmp_path, monkeypatch, capsys):
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42178"

    def fails(error):
        def init(self, *args, **kwargs):  # where a collective of the process group would fail
            raise error

        return init

    monkeypatch.setattr(Trainer, "__init__", fails(RuntimeError(gloo)))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["train", *helpers.cli_overrides(data_dir, tmp_path / "run", parallel="ddp"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: process 1 lost contact with the others ({gloo}): one of them stopped (its own error, or "
        "torchrun's report, says why); fix that and continue with --resume"
    ]
    # any other error keeps its traceback: a bug, or NCCL failing on this process (out of memory)
    for own in (RuntimeError("a bug"), torch.distributed.DistBackendError("NCCL error: out of memory")):
        monkeypatch.setattr(Trainer, "__init__", fails(own))
        with pytest.raises(type(own), match=str(own)):
            main(argv)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process has no peers to lose, whatever an error says
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(Trainer, "__init__", fails(RuntimeError("Connection reset by peer")))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        main(["train", *helpers.cli_overrides(data_dir, tmp_path / "one"), "--no-progress"])


def test_checkpoint_formats(runs):
    root, _ = runs
    full = helpers.step_dir(root / "fsdp", 12)  # gathered to rank 0: the single-process format
    assert {p.name for p in full.iterdir()} == {
        "model.safetensors",
        "train_state.pt",
        "config.json",
        "tokenizer.json",
        "meta.json",
        "COMPLETE",
    }
    sharded = load_checkpoint(helpers.step_dir(root / "one_to_two", 12))
    assert sharded.layout == "sharded"
    assert sorted(sharded.meta["shards"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (sharded.path / "model.safetensors").exists()
    assert "optimizer" not in sharded.train_state() and sharded.train_state()["optimizer_param_groups"]
    # `tango-lm eval` reads a sharded checkpoint in one process and agrees with the trainer's dev NLL.
    res = evaluate_checkpoint(str(sharded.path), "dev", max_windows=8)
    assert res["nll"] == pytest.approx(sharded.meta["dev_nll"], rel=LOSS_RTOL)


# -- N -> M resume -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ddp", "fsdp", "sharded"])
def test_two_rank_checkpoint_resumes_on_one_process(runs, data_dir, tmp_path, name):
    root, _ = runs
    model, train_kw, _ = RUNS[name]
    cut = _cut_at_8(root / name, tmp_path / "cut")
    resumed = train(helpers.run_config(data_dir, cut, model, **{**train_kw, "parallel": "none"}), resume=True)
    uninterrupted = _losses(root / name)
    assert sorted(resumed.losses) == [9, 10, 11, 12]
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(uninterrupted[step], rel=LOSS_RTOL), step
    assert [r["step"] for r in helpers.loss_records(cut)] == list(range(1, 13))
    assert resumed.summary["tokens"] == json.loads((root / name / "summary.json").read_text())["tokens"]


def test_one_process_checkpoint_resumes_on_two_ranks(runs):
    root, refs = runs
    losses = _losses(root / "one_to_two")
    assert sorted(losses) == list(range(1, 13))
    for step in range(9, 13):
        assert losses[step] == pytest.approx(refs["one_to_two"].losses[step], rel=LOSS_RTOL), step
    assert load_checkpoint(helpers.step_dir(root / "one_to_two", 12)).layout == "sharded"
    assert load_checkpoint(helpers.step_dir(root / "one_to_two", 8)).layout == "full"


def test_ddp_on_one_process_is_plain_training(data_dir, tmp_path):
    plain = train(helpers.run_config(data_dir, tmp_path / "plain", steps=2, eval_every=2, save_every=2))
    ddp = train(helpers.run_config(data_dir, tmp_path / "ddp", steps=2, eval_every=2, save_every=2, parallel="ddp"))
    assert ddp.losses == plain.losses and ddp.summary["test_nll"] == plain.summary["test_nll"]
    assert "world_size" not in load_checkpoint(tmp_path / "ddp").meta


# -- bad input -----------------------------------------------------------------------------------
def _torchrun_env(monkeypatch, world_size: int) -> None:
    """What torchrun sets for rank 0; the checks below run before any process group is formed."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)


def _fails(capsys, argv: list[str], *roots: Path) -> str:
    before = helpers.snapshot(*roots)
    assert main(argv) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    assert helpers.snapshot(*roots) == before, "a failed launch changed files"
    return line


BAD_LAUNCHES = {
    # (world size, model overrides, train overrides, message)
    "indivisible_batch": (
        3,
        {},
        {"parallel": "ddp", "batch_size": 4},
        "train.batch_size=4 (the global micro-batch) does not split evenly over 3 processes; "
        "set train.batch_size to a multiple of 3",
    ),
    "fsdp_single_process": (
        1,
        {},
        {"parallel": "fsdp"},
        "train.parallel=fsdp needs torchrun with 2 or more processes; use train.parallel=none",
    ),
    "none_under_torchrun": (2, {}, {"parallel": "none"}, "set train.parallel=ddp or train.parallel=fsdp"),
    "fsdp_active_width": (2, AW, {"parallel": "fsdp"}, "does not work with train.parallel=fsdp"),
    "fsdp_moe": (2, {"arch": "moe"}, {"parallel": "fsdp"}, "model.arch=moe leaves some parameters"),
}


@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
def test_bad_launch_is_one_line_exit_2_and_writes_nothing(runs, data_dir, tmp_path, monkeypatch, capsys, case):
    world, model, train_kw, message = BAD_LAUNCHES[case]
    root, _ = runs
    if world > 1:
        _torchrun_env(monkeypatch, world)
    existing = shutil.copytree(root / "ddp", tmp_path / "existing")  # a run a bad resume must not touch
    for out, flags in ((tmp_path / "new", []), (existing, ["--resume"])):
        line = _fails(capsys, ["train", *_overrides(data_dir, out, model, train_kw), *flags], tmp_path)
        assert message in line
        assert not (tmp_path / "new").exists()


def _sharded_copy(runs, data_dir, tmp_path) -> tuple[Path, Path, list[str]]:
    root, _ = runs
    model, train_kw, _ = RUNS["sharded"]
    out = shutil.copytree(root / "sharded", tmp_path / "run")
    argv = ["train", *_overrides(data_dir, out, model, {**train_kw, "parallel": "none", "steps": 16}), "--resume"]
    return out, helpers.step_dir(out, 12) / "shards", argv


def test_missing_shard_is_refused(runs, data_dir, tmp_path, capsys):
    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    (shards / "__1_0.distcp").unlink()
    line = _fails(capsys, argv, out)
    assert "is missing shard shards/__1_0.distcp" in line and "copy the whole step directory" in line
    assert main(["eval", str(helpers.step_dir(out, 12)), "--split", "dev"]) == 2
    assert "missing shard" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_truncated_shard_is_refused(runs, data_dir, tmp_path, capsys):
    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    data = (shards / "__0_0.distcp").read_bytes()
    (shards / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    assert "truncated or altered shard shards/__0_0.distcp" in _fails(capsys, argv, out)


def test_flipped_bit_in_a_shard_is_refused(runs, data_dir, tmp_path, capsys):
    # DCP reads a flipped bit as a valid number: only the sha256 in meta.json catches it.
    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    data = bytearray((shards / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10
    (shards / "__1_0.distcp").write_bytes(bytes(data))
    message = "has a shards/__1_0.distcp that does not match the sha256 in its meta.json"
    assert message in _fails(capsys, argv, out)
    assert main(["eval", str(helpers.step_dir(out, 12)), "--split", "dev"]) == 2
    assert message in helpers.assert_one_error_line(capsys.readouterr().err)


def _without_shard_sums(step: Path) -> None:
    """As a sharded checkpoint written before shard sums were recorded (they are optional on load)."""
    meta = json.loads((step / "meta.json").read_text())
    meta["sha256"] = {k: v for k, v in meta["sha256"].items() if not k.startswith("shards/")}
    (step / "meta.json").write_text(json.dumps(meta))


def test_a_damaged_shard_without_sums_is_one_line(runs, data_dir, tmp_path, capsys):
    # DCP reports a read failure as CheckpointException, a BaseException: it escaped as a traceback.
    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    data = bytearray((shards / "__1_0.distcp").read_bytes())
    data[100:2000] = bytes(1900)
    (shards / "__1_0.distcp").write_bytes(bytes(data))
    _without_shard_sums(helpers.step_dir(out, 12))
    assert "has unreadable shards" in _fails(capsys, argv, out)
    assert main(["eval", str(helpers.step_dir(out, 12)), "--split", "dev"]) == 2
    assert "has unreadable shards" in helpers.assert_one_error_line(capsys.readouterr().err)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on this test's own save
def test_a_shard_item_that_is_not_a_tensor_is_refused_in_one_line(runs, data_dir, tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    reader = dcp.FileSystemReader(str(shards))
    state = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in reader.read_metadata().state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    victim = next(k for k in state if k.startswith("model.") and k.endswith("norm.weight"))
    state[victim] = "not a tensor"  # DCP pickles it as a bytes item
    shutil.rmtree(shards)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    step = helpers.step_dir(out, 12)
    meta = json.loads((step / "meta.json").read_text())
    meta["shards"] = {p.name: p.stat().st_size for p in sorted(shards.iterdir())}
    (step / "meta.json").write_text(json.dumps(meta))
    _without_shard_sums(step)
    assert f"hold a non-tensor item {victim!r} where a tensor belongs" in _fails(capsys, argv, out)


def test_world_size_without_a_rendezvous_address_is_one_line(data_dir, tmp_path, monkeypatch, capsys):
    _torchrun_env(monkeypatch, 2)
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    argv = ["train", *_overrides(data_dir, tmp_path / "run", {}, {"parallel": "ddp"})]
    assert "WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set; launch with torchrun" in _fails(capsys, argv)
    assert not (tmp_path / "run").exists()


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_shard_metadata_is_not_unpickled_blindly(runs, data_dir, tmp_path, capsys, monkeypatch):
    out, shards, argv = _sharded_copy(runs, data_dir, tmp_path)
    (shards / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    meta_path = helpers.step_dir(out, 12) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["shards"][".metadata"] = (shards / ".metadata").stat().st_size  # as if written that way
    del meta["sha256"]["shards/.metadata"]
    meta_path.write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    line = _fails(capsys, argv, out)
    assert "unreadable shard metadata" in line and "posix.system is not allowed" in line
    assert not (tmp_path / "pwned").exists()
