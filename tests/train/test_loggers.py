"""`train.loggers` (train/loggers/): TensorBoard and W&B get every scalar of the JSONL log, MFU
and peak memory included; a resumed run continues the same TensorBoard directory and W&B run id.

The event files and the offline W&B run are read back from disk, so these tests check what a user
would see, not what was handed to a library."""

from __future__ import annotations

import json
import signal
import struct
import sys
from pathlib import Path

import pytest
import torch

from tango_lm.cli import main
from tango_lm.errors import UserError
from tango_lm.stop_signals import Stopped
from tango_lm.train.config import RunConfig
from tango_lm.train.loggers import scalars
from tango_lm.train.run_dir import run_files
from tango_lm.train.trainer import Trainer, train
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def jsonl_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    out = {}
    for record in helpers.read_metrics(run_dir):
        for tag, value in scalars(record).items():
            out[tag, record["step"]] = value
    return out


def tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice {steps}"
        out.update({(tag, e.step): e.value for e in events.Scalars(tag)})
    return out


def tensorboard_scalars_of_every_file(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every scalar event of every event file, later files over earlier ones, no purge applied."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                out[value.tag, event.step] = (
                    float(value.tensor.float_val[0]) if value.HasField("tensor") else value.simple_value
                )
    return out


def wandb_records(path: Path):
    """The protobuf records of a `.wandb` file: a 7-byte header, then LevelDB-log blocks of 32 KiB
    whose records (crc32, length, type: full/first/middle/last) carry serialized `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += room
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_files(run_dir: Path) -> list[Path]:
    """Every offline run's `.wandb` file, oldest attempt first, once W&B's service has written it:
    `run.finish()` returns before the service closes the file, which holds only its 7-byte header
    until then (a loaded machine read it so: no history). Tearing the service down, as a process's
    exit does, closes them all; the next `wandb.init` starts a new one."""
    import wandb

    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_history(run_dir: Path) -> tuple[set[str], dict[tuple[str, int], float]]:
    """Run ids and history of every offline run directory, later attempts overriding earlier ones."""
    ids, out = set(), {}
    for path in wandb_files(run_dir):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                out.update({(k, row["_step"]): v for k, v in row.items() if not k.startswith("_")})
    return ids, out


def wandb_exit_codes(run_dir: Path) -> list[int]:
    """The exit code each attempt's offline W&B run recorded at its end, oldest attempt first."""
    return [
        record.exit.exit_code
        for path in wandb_files(run_dir)
        for record in wandb_records(path)
        if record.WhichOneof("record_type") == "exit"
    ]


def float32(values: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    return {k: torch.tensor(v, dtype=torch.float32).item() for k, v in values.items()}


def test_every_jsonl_scalar_reaches_tensorboard_and_wandb(data_dir, tmp_path, offline_wandb):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    result = train(helpers.run_config(data_dir, out, steps=6, loggers=["jsonl", "tensorboard", "wandb"]))
    logged = jsonl_scalars(out)
    train_tags = {tag for tag, step in logged if step == 3}
    assert train_tags == {
        f"train/{k}" for k in ("loss", "tokens", "tokens_per_s", "mfu", "peak_memory_mib", "lr", "grad_norm")
    }
    assert {("dev/dev_nll", 4), ("dev/best", 4), ("summary/test_nll", 6), ("summary/mfu", 6)} <= logged.keys()
    assert logged["summary/test_nll", 6] == result.summary["test_nll"]
    for record in helpers.read_metrics(out):
        if "loss" in record:
            assert 0 < record["mfu"] < 1 and record["peak_memory_mib"] > 10
    assert tensorboard_scalars(out) == float32(logged)  # TensorBoard keeps float32
    ids, history = wandb_history(out)
    assert ids == {json.loads((out / "wandb.json").read_text())["run_id"]}
    assert history == logged


def interrupt_after_6(run: RunConfig, monkeypatch) -> None:
    """Train `run` (checkpoints every 4 steps) until step 6 is logged, then stop as a kill would:
    steps 5 and 6 are logged and lost."""
    original = Trainer.train_step

    def stop_after_6(self):
        if self.step == 6:
            raise KeyboardInterrupt
        return original(self)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop_after_6)
        with pytest.raises(KeyboardInterrupt):
            train(run)


def test_a_resumed_run_continues_the_same_tensorboard_and_wandb_runs(data_dir, tmp_path, offline_wandb, monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "cut"
    run = helpers.run_config(data_dir, out, steps=8, save_every=4, loggers="jsonl,tensorboard,wandb")
    interrupt_after_6(run, monkeypatch)
    first_id = json.loads((out / "wandb.json").read_text())["run_id"]
    train(run, resume=True)
    logged = jsonl_scalars(out)
    assert sorted({step for tag, step in logged if tag == "train/loss"}) == list(range(1, 9))
    assert tensorboard_scalars(out) == float32(logged)  # the killed attempt's steps 5, 6 are purged
    # one file, the resume's: TensorBoard's Rust reader ignores a purge_step, so the killed attempt's goes
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    ids, history = wandb_history(out)
    assert ids == {first_id} and len(list((out / "wandb").glob("offline-run-*"))) == 2
    assert history == logged
    # The interrupted attempt is marked failed on the dashboard (it showed as finished, exit code 0)
    assert wandb_exit_codes(out) == [130, 0]


@pytest.mark.parametrize(
    ("stop", "code"), [(lambda: UserError("training stopped at step 3"), 1), (lambda: Stopped(signal.SIGTERM), 143)]
)
def test_a_run_stopped_by_an_error_or_sigterm_is_marked_failed_in_wandb(
    data_dir, tmp_path, offline_wandb, monkeypatch, stop, code
):
    def stop_at_3(self):
        if self.step == 3:
            raise stop()
        return original(self)

    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", stop_at_3)
    out = tmp_path / "run"
    with pytest.raises((UserError, Stopped)):
        train(helpers.run_config(data_dir, out, steps=6, loggers="jsonl,wandb"))
    assert wandb_exit_codes(out) == [code]


def test_a_damaged_wandb_run_id_file_is_refused_not_replaced(data_dir, tmp_path, offline_wandb):
    # A new id was made and written over it: the rest of the run went to a second W&B run.
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=2, save_every=2, loggers="jsonl,wandb"))
    (out / "wandb.json").write_text('{"run_id": "5c1a7bb6"')

    def files():  # W&B's service may still be writing its own logs under wandb/ after the run
        return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and out / "wandb" not in p.parents}

    before = files()
    longer = helpers.run_config(data_dir, out, steps=4, save_every=2, loggers="jsonl,wandb")
    with pytest.raises(UserError, match=r"wandb.json names no W&B run id \(.*\); restore it .* or remove it"):
        train(longer, resume=True)
    assert files() == before and out / "wandb.json" in before
    (out / "wandb.json").unlink()  # as the error allows: the rest is a new W&B run
    assert train(longer, resume=True).summary["steps"] == 4
    # a fresh start removes the id (quickstart --fresh, a sweep's retry) rather than continue the
    # old W&B run
    from tango_lm.train.run_dir import remove_run_files

    remove_run_files(out)
    assert not (out / "wandb.json").exists() and run_files(out) == []


def test_a_logger_package_that_fails_to_import_is_one_line(data_dir, tmp_path, capsys, monkeypatch):
    # An installed wandb whose import fails (a protobuf clash, say) was a traceback, exit 1.
    fake = tmp_path / "site" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("protobuf mismatch")\n')
    monkeypatch.syspath_prepend(str(fake.parent))
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out), "train.loggers=[jsonl,wandb]"]) == 2
    err = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "the wandb package fails to import (protobuf mismatch); reinstall it" in err
    assert not out.exists()


def test_wandb_failures_retire_its_service(data_dir, tmp_path, offline_wandb, monkeypatch):
    # A service W&B lost contact with was reused by the next wandb.init in the process: a sweep's
    # later runs all failed, and W&B's exit hook printed a traceback after the error line.
    import wandb

    from tango_lm.train.loggers import WandbLogger

    retired = []
    monkeypatch.setattr(wandb, "teardown", lambda *a, **k: retired.append(1))

    def lost(*args, **kwargs):
        raise ConnectionResetError("Connection lost")

    with monkeypatch.context() as m:
        m.setattr(wandb, "init", lost)
        with pytest.raises(UserError, match=r"wandb could not start a run \(Connection lost\)"):
            train(helpers.run_config(data_dir, tmp_path / "a", steps=2, loggers="jsonl,wandb"))
    assert retired == [1]
    logger = WandbLogger.__new__(WandbLogger)
    logger.run = type("Run", (), {"finish": lambda self, exit_code=0: lost()})()
    with pytest.raises(ConnectionResetError):
        logger.close()
    assert retired == [1, 1]


def test_tensorboard_added_on_a_resume_gets_the_whole_history(data_dir, tmp_path, monkeypatch):
    # It got the records from the checkpoint's step on only: steps 1-3 were missing from its curves.
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, save_every=4))
    train(helpers.run_config(data_dir, out, steps=8, save_every=4, loggers="jsonl,tensorboard"), resume=True)
    logged = jsonl_scalars(out)
    assert sorted({step for tag, step in logged if tag == "train/loss"}) == list(range(1, 9))
    assert tensorboard_scalars(out) == float32(logged)


def test_a_logger_that_cannot_start_leaves_no_run_files(data_dir, tmp_path, offline_wandb, monkeypatch):
    # W&B without a key wrote config.json and config.yaml first: the retry its error suggests was
    # refused as "already holds a run; pass --resume".
    import wandb

    def no_key(*args, **kwargs):
        raise RuntimeError("No API key configured")

    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=2, loggers="jsonl,wandb")
    with monkeypatch.context() as m:
        m.setattr(wandb, "init", no_key)
        m.setenv("WANDB_MODE", "online")
        with pytest.raises(UserError, match=r"a run \(No API key configured\); run `wandb login`, or set WANDB_MODE="):
            train(run)
        m.setenv("WANDB_MODE", "offline")  # then no login is missing: the error itself says what to fix
        with pytest.raises(UserError, match=r"configured\); fix what it names, or drop wandb from train.loggers$"):
            train(run)
    assert run_files(out) == []
    assert train(run).summary["steps"] == 2  # the same command again, no --resume


def test_logger_names_are_checked(data_dir, tmp_path, capsys):
    base = {"model": helpers.TINY_MODEL, "data": {"dir": str(data_dir)}}
    assert RunConfig.from_dict({**base, "train": {"loggers": "jsonl, tensorboard"}}).train.loggers == [
        "jsonl",
        "tensorboard",
    ]
    assert RunConfig.from_dict(base).train.loggers == ["jsonl"]
    for value, message in (
        (["jsonl", "mlflow"], "unknown logger 'mlflow'"),
        (["tensorboard"], "must include jsonl"),
        (["jsonl", "jsonl"], "twice"),
        (3, "list of logger names"),
    ):
        with pytest.raises(UserError, match=message):
            RunConfig.from_dict({**base, "train": {"loggers": value}})
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out), "train.loggers=[wandb]"]) == 2
    assert "must include jsonl" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_missing_logger_package_names_the_extra(data_dir, tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    out = tmp_path / "run"
    assert main(["train", *helpers.cli_overrides(data_dir, out), "train.loggers=[jsonl,wandb]"]) == 2
    err = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "pip install 'tango-lm[wandb]'" in err
    assert not out.exists()


def test_a_failing_logger_stops_the_run_with_one_error_line(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tango_lm.train.loggers import TensorBoardLogger

    def full_disk(self, record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardLogger, "log", full_disk)
    with pytest.raises(UserError, match="the tensorboard logger failed .*No space left on device"):
        train(helpers.run_config(data_dir, tmp_path / "run", steps=4, loggers=["jsonl", "tensorboard"]))


def test_resuming_a_finished_run_logs_its_summary_once(data_dir, tmp_path):
    # The finished run's summary sat at the last step, below TensorBoard's purge step: twice.
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=4, save_every=2, loggers="jsonl,tensorboard")
    train(run)
    train(run, resume=True)
    assert tensorboard_scalars(out) == float32(jsonl_scalars(out))  # tensorboard_scalars refuses a step twice
    longer = helpers.run_config(data_dir, out, steps=6, save_every=2, loggers="jsonl,tensorboard")
    train(longer, resume=True)
    logged = jsonl_scalars(out)
    assert {step for tag, step in logged if tag.startswith("summary/")} == {6}
    assert tensorboard_scalars(out) == float32(logged)
    # What a reader that ignores purge steps sees (TensorBoard's default, Rust one): every event file
    assert tensorboard_scalars_of_every_file(out) == float32(logged)


def test_a_killed_attempts_lost_wandb_history_is_sent_again(data_dir, tmp_path, offline_wandb, monkeypatch):
    # A SIGKILL ends W&B's service before it writes the history it holds: the resumed attempt's
    # offline directory gets the kept records up to the checkpoint again.
    out = tmp_path / "cut"
    run = helpers.run_config(data_dir, out, steps=8, save_every=4, loggers="jsonl,wandb")
    interrupt_after_6(run, monkeypatch)
    for path in wandb_files(out):  # as if nothing had been flushed
        path.unlink()
    train(run, resume=True)
    assert wandb_history(out)[1] == jsonl_scalars(out)


def test_tensorboard_left_out_of_a_resume_gets_the_steps_it_missed(data_dir, tmp_path):
    # Its events existed, so it was sent only the checkpoint's step again: steps 5-7, trained
    # while tensorboard was not in train.loggers, were missing from its curves.
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    for steps, loggers in ((4, "jsonl,tensorboard"), (8, "jsonl"), (10, "jsonl,tensorboard")):
        train(helpers.run_config(data_dir, out, steps=steps, save_every=4, eval_every=2, loggers=loggers), resume=True)
    logged = jsonl_scalars(out)
    assert sorted({step for tag, step in logged if tag == "train/loss"}) == list(range(1, 11))
    assert tensorboard_scalars(out) == float32(logged)


def test_a_resume_whose_logger_cannot_start_leaves_the_finished_run_whole(
    data_dir, tmp_path, offline_wandb, monkeypatch
):
    # The resume truncated metrics.jsonl and removed summary.json before the loggers opened: a typo
    # in the W&B project took a finished run out of `tango-lm report`.
    pytest.importorskip("tensorboard")
    import wandb

    def bad_project(*args, project=None, **kwargs):
        raise RuntimeError(f"Invalid project name {project!r}: cannot contain '/'")

    monkeypatch.setattr(wandb, "init", bad_project)
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, save_every=2))
    before = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    bad = helpers.run_config(
        data_dir, out, steps=4, save_every=2, loggers="jsonl,tensorboard,wandb", wandb_project="a/b"
    )
    with pytest.raises(UserError, match=r"wandb could not start a run \(.*project.*\); fix what it names"):
        train(bad, resume=True)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not (out / "tensorboard").exists()  # W&B opens first: its refusal leaves no event file


def test_a_tensorboard_path_that_is_a_file_is_said_so(data_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("x")
    with pytest.raises(UserError, match=r"tensorboard is a file, not TensorBoard's folder; move it away or drop"):
        train(helpers.run_config(data_dir, out, steps=2, loggers="jsonl,tensorboard"))


def test_a_bad_wandb_setting_is_named_in_full_without_login_advice(data_dir, tmp_path, offline_wandb, monkeypatch):
    # Only "1 validation error for Settings" was shown, with `wandb login` as the fix. (W&B keeps
    # settings of an earlier run in the process, so the refusal is its message, raised here.)
    import wandb

    def bad_mode(*args, **kwargs):
        raise ValueError(
            "1 validation error for Settings\nmode\n  Input should be 'online' or 'offline' [input_value='bogus']"
        )

    monkeypatch.setattr(wandb, "init", bad_mode)
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(UserError) as info:
        train(helpers.run_config(data_dir, tmp_path / "run", steps=2, loggers="jsonl,wandb"))
    assert str(info.value) == (
        "wandb could not start a run (1 validation error for Settings mode Input should be 'online' or 'offline' "
        "[input_value='bogus']); fix what it names, or drop wandb from train.loggers"
    )


def test_tensorboard_removes_only_the_event_files_it_wrote(data_dir, tmp_path):
    # It removed every events.out.tfevents.* file in RUN/tensorboard: a user's own, or another
    # run's where the folder is a link to a shared one.
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    shared = tmp_path / "shared"
    with SummaryWriter(str(shared), filename_suffix=".theirs") as other:
        other.add_scalar("theirs/x", 1.0, 1)
    theirs = sorted(p.name for p in shared.iterdir())
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").symlink_to(shared, target_is_directory=True)
    run = helpers.run_config(data_dir, out, steps=4, save_every=2, loggers="jsonl,tensorboard")
    train(run)
    train(helpers.run_config(data_dir, out, steps=6, save_every=2, loggers="jsonl,tensorboard"), resume=True)
    events = sorted(p.name for p in shared.glob("events.out.tfevents.*"))
    assert set(theirs) < set(events) and len(events) == len(theirs) + 1  # theirs, and this run's one file


def test_a_start_that_wandb_opened_and_tensorboard_stopped_runs_again_as_it_was(data_dir, tmp_path, offline_wandb):
    # W&B opens first and writes its id; TensorBoard then refuses: the same command, once fixed,
    # is a fresh start still (wandb.json is no run file), not "already holds a run".
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("x")
    run = helpers.run_config(data_dir, out, steps=2, loggers="jsonl,tensorboard,wandb")
    with pytest.raises(UserError, match="tensorboard is a file"):
        train(run)
    assert (out / "wandb.json").is_file() and run_files(out) == []
    (out / "tensorboard").unlink()
    assert train(run).summary["steps"] == 2


def test_a_resume_without_metrics_jsonl_keeps_the_tensorboard_history(data_dir, tmp_path, capsys, monkeypatch):
    # metrics.jsonl's corruption error says "fix or remove it"; removed, the resume rewrote the
    # event files from its (no) kept records: steps 1-4 were gone from TensorBoard too.
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, save_every=2, loggers="jsonl,tensorboard"))
    history = tensorboard_scalars(out)
    assert {step for tag, step in history if tag == "train/loss"} == {1, 2, 3, 4}
    (out / "metrics.jsonl").unlink()
    before = {path: digest for path, (_, digest) in helpers.snapshot(out).items()}
    run = ["train", str(out), "--resume", "train.steps=6", "train.loggers=[jsonl,tensorboard]"]
    assert main(run) == 2
    said = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "metrics.jsonl is missing, and resuming rewrites" in said and "steps up to 4 would be lost" in said
    assert {path: digest for path, (_, digest) in helpers.snapshot(out).items()} == before
    assert tensorboard_scalars(out) == history
    # without TensorBoard in the list, or with its folder moved away, the run goes on
    (out / "tensorboard").rename(tmp_path / "kept-tensorboard")
    assert main(run) == 0
    assert {step for tag, step in tensorboard_scalars(out) if tag == "train/loss"} == {5, 6}
    # a checkpoint saved before anything was logged (log_every past save_every): the event files
    # hold no value, metrics.jsonl is not written yet, and nothing is lost by resuming
    quiet = helpers.run_config(
        data_dir, tmp_path / "quiet", steps=8, log_every=50, eval_every=50, loggers="jsonl,tensorboard"
    )
    interrupt_after_6(quiet, monkeypatch)  # checkpoint at step 4, nothing logged before the stop
    assert not (tmp_path / "quiet" / "metrics.jsonl").exists()
    train(quiet, resume=True)
