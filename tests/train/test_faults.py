"""Faults of the machine are errors, not tracebacks: a full disk during a save (an injected
ENOSPC), a read-only output folder, `--resume` when `checkpoints` is a file. One `error:` line,
exit code 2, no partial `.tmp-step-*` left, earlier checkpoints intact and nothing rewritten
before the failure is known; leftovers of a kill are removed at the next start and every file of
a checkpoint has the same mode."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tango_lm.train import checkpoint
from tango_lm.train.checkpoint import complete_steps, load_checkpoint
from tango_lm.train.trainer import train
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = {"steps": 8, "save_every": 4, "eval_every": 4}


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    rc, _, err, _ = helpers.run_main(capsys, argv)
    return rc, err


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    train(helpers.run_config(data_dir, out, **TRAIN))
    return out


@pytest.fixture
def make_read_only():
    """Make a directory truly unwritable: chmod for a normal user; a read-only bind mount for root
    (who writes through any mode); skipped where neither is possible."""
    mounts: list[Path] = []
    changed: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() != 0:
            for p in [path, *path.rglob("*")]:
                p.chmod(p.stat().st_mode & ~0o222)
                changed.append(p)
            return
        bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
        if bind.returncode:
            pytest.skip("root without mount rights: cannot make a directory read-only")
        mounts.append(path)
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only")

    yield make
    for path in mounts:
        subprocess.run(["umount", str(path)], check=True)
    for p in changed:
        p.chmod(p.stat().st_mode | 0o200)


def test_a_full_disk_during_a_save(finished, data_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = ["train", *helpers.cli_overrides(data_dir, out, **TRAIN)]
    real, calls = checkpoint.save_file, []

    def save_file(state, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the step-8 save: half a file, then the disk is full
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(state, path, metadata=metadata)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "save_file", save_file)
        rc, err = run_cli(capsys, argv)
    assert rc == 2
    line = helpers.assert_one_error_line(err)
    assert "cannot write checkpoint step-00000008" in line and "No space left on device" in line
    assert "--resume" in line
    assert helpers.step_names(out) == ["step-00000004"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no .tmp-step-*
    load_checkpoint(helpers.step_dir(out, 4)).model_state()  # intact

    rc, err = run_cli(capsys, [*argv, "--resume"])  # space freed: continue
    assert rc == 0, err
    assert helpers.loss_records(out) == helpers.loss_records(finished)  # as if the disk had never filled
    assert helpers.read_metrics(out)[-1]["test_nll"] == helpers.read_metrics(finished)[-1]["test_nll"]


def _safetensors_full(path):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _torch_save_full(path):
    Path(path).write_bytes(b"PK")
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # what torch says


def _json_full(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize(
    "writer,fail", [("save_file", _safetensors_full), ("torch.save", _torch_save_full), ("_write_json", _json_full)]
)
def test_each_writer_of_a_save_can_find_the_disk_full(data_dir, tmp_path, monkeypatch, writer, fail):
    """Each writer reports a full disk its own way (safetensors and torch with their own errors)."""
    from tango_lm.errors import UserError

    out = tmp_path / "run"
    target = checkpoint.torch if writer == "torch.save" else checkpoint
    name = writer.split(".")[-1]
    real = getattr(target, name)

    def writes(*args, **kwargs):
        path = args[0] if name == "_write_json" else args[1]
        if "step-00000002" in str(path) and not str(path).endswith("config.json"):
            fail(path)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, writes)
    with pytest.raises(UserError, match="cannot write checkpoint step-00000002 .* MiB free there"):
        train(helpers.run_config(data_dir, out, steps=2, save_every=1, eval_every=2))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]


def test_a_really_full_disk(data_dir, tmp_path, capsys):
    """A 1,200 KiB tmpfs fills up during the second save (root with mount rights only)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(disk)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root with mount rights for a small tmpfs")
    try:
        argv = [
            "train",
            *helpers.cli_overrides(data_dir, disk / "run", steps=8, save_every=4, eval_every=4),
            "model.d_model=64",
            "model.width=256",
        ]
        rc, err = run_cli(capsys, argv)
        assert rc == 2
        assert "cannot write checkpoint step-00000008" in helpers.assert_one_error_line(err)
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["step-00000004"]
        load_checkpoint(helpers.step_dir(disk / "run", 4)).build_model()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_resume_when_checkpoints_is_a_file_rewrites_nothing(finished, tmp_path, capsys, data_dir):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a directory")
    before = helpers.snapshot(run)
    rc, err = run_cli(capsys, ["train", *helpers.cli_overrides(data_dir, run, **TRAIN), "--resume"])
    assert rc == 2
    assert f"{run / 'checkpoints'} is a file, not a checkpoint directory" in helpers.assert_one_error_line(err)
    assert helpers.snapshot(run) == before  # config files and metrics as they were


def test_resume_with_a_link_where_a_later_step_goes_rewrites_nothing(finished, tmp_path, capsys, data_dir):
    # Found at the save of step 12, after the resume had rewritten config.json, config.yaml and
    # metrics.jsonl, removed summary.json and trained four steps.
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    (run / "checkpoints" / "step-00000012").symlink_to(tmp_path, target_is_directory=True)
    before = helpers.snapshot(run)
    argv = ["train", *helpers.cli_overrides(data_dir, run, **{**TRAIN, "steps": 12}), "--resume"]
    rc, err = run_cli(capsys, argv)
    assert rc == 2 and helpers.snapshot(run) == before
    assert helpers.assert_one_error_line(err) == (
        f"error: {run / 'checkpoints' / 'step-00000012'} is a link, not a checkpoint directory; move it away and run again"
    )


def test_an_out_dir_that_is_a_file(data_dir, tmp_path, capsys):
    (tmp_path / "run").write_text("x")
    rc, err = run_cli(capsys, ["train", *helpers.cli_overrides(data_dir, tmp_path / "run", **TRAIN)])
    assert rc == 2 and "is a file, not a directory" in helpers.assert_one_error_line(err)
    rc, err = run_cli(capsys, ["train", *helpers.cli_overrides(data_dir, tmp_path / "run" / "a", **TRAIN)])
    assert rc == 2 and f"lies under {tmp_path / 'run'}, which is a file" in helpers.assert_one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and (tmp_path / "run").read_text() == "x"


def test_a_read_only_output_folder(finished, data_dir, tmp_path, capsys, make_read_only):
    shelf = tmp_path / "shelf"
    run = Path(shutil.copytree(finished, shelf / "run"))
    make_read_only(shelf)
    before = helpers.snapshot(shelf)
    for argv in (
        ["train", *helpers.cli_overrides(data_dir, shelf / "new", **TRAIN)],
        ["train", *helpers.cli_overrides(data_dir, run, **{**TRAIN, "steps": 12}), "--resume"],
    ):
        rc, err = run_cli(capsys, argv)
        assert rc == 2
        assert "(no permission, or a read-only file system)" in helpers.assert_one_error_line(err)
    assert helpers.snapshot(shelf) == before


def test_a_full_disk_while_preparing_data(tmp_path, monkeypatch, capsys):
    from tango_lm.data import shards

    (tmp_path / "doc.txt").write_text("a document\n")

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards._ShardWriter, "_close_current", full)
    rc, err = run_cli(
        capsys,
        [
            "data",
            "prepare",
            "text",
            str(tmp_path / "doc.txt"),
            "--out",
            str(tmp_path / "d"),
            "--tokenizer",
            "byte",
            "--no-progress",
        ],
    )
    assert rc == 2
    assert "cannot write the dataset" in helpers.assert_one_error_line(err) and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]  # no half-written dataset, no lock


def test_leftovers_of_a_kill_are_removed_at_the_next_start(finished, data_dir, tmp_path):
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    root = run / "checkpoints"
    (root / "step-00000006").mkdir()  # a prune killed after removing COMPLETE, or an empty rename target
    (root / "step-00000007").mkdir()
    (root / "step-00000007" / "model.safetensors").write_bytes(b"half")
    (root / ".tmp-step-00000009-1234").mkdir()
    (root / ".old-step-00000002-99").mkdir()
    train(helpers.run_config(data_dir, run, **TRAIN), resume=True)  # finished: trains nothing more
    assert sorted(p.name for p in root.iterdir()) == [p.name for p in complete_steps(root)]
    assert helpers.step_names(run) == ["step-00000004", "step-00000008"]


def test_every_file_of_a_checkpoint_has_the_same_mode(finished):
    for step in complete_steps(finished / "checkpoints"):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in step.iterdir()}
        assert len(set(modes.values())) == 1, modes


def _stop_mid_write(stop: str) -> None:
    if stop == "SIGTERM":  # `timeout`, `kill`: the handler raises at the next bytecode
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("stop", "code", "line"), [("SIGINT", 130, "interrupted; "), ("SIGTERM", 143, "stopped by SIGTERM; ")]
)
def test_a_run_stopped_while_it_writes_a_checkpoint_leaves_no_half_copy(
    finished, data_dir, tmp_path, monkeypatch, capsys, stop, code, line
):
    # The half-written .tmp-step-* stayed (42 MB at a 26 MB model) until the run started again,
    # and SIGTERM killed the process outright: no line saying how to continue, W&B left running.
    out = tmp_path / "run"
    argv = ["train", *helpers.cli_overrides(data_dir, out, **TRAIN)]
    real, handler = checkpoint.torch.save, signal.getsignal(signal.SIGTERM)

    def save(obj, path, *args, **kwargs):
        if "step-00000008" in str(path):
            Path(path).write_bytes(b"PK")  # half a file
            _stop_mid_write(stop)
        return real(obj, path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(checkpoint.torch, "save", save)
        rc, err = run_cli(capsys, argv)
    assert rc == code
    assert err.startswith(line) and "from its checkpoint of step 4" in err and "--resume" in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004"]  # no .tmp-step-*
    assert signal.getsignal(signal.SIGTERM) == handler  # put back
    rc, err = run_cli(capsys, [*argv, "--resume"])
    assert rc == 0, err
    assert helpers.loss_records(out) == helpers.loss_records(finished)


def test_a_sharded_save_stopped_while_its_shards_are_written_leaves_no_half_copy(data_dir, tmp_path, monkeypatch):
    from tango_lm.train import trainer_checkpoints

    def save_shards(path, tensors, distributed):
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_checkpoints, "save_shards", save_shards)
    with pytest.raises(KeyboardInterrupt):
        train(helpers.run_config(data_dir, tmp_path / "run", steps=2, save_every=1, checkpoint_format="sharded"))
    assert not list((tmp_path / "run" / "checkpoints").iterdir())
