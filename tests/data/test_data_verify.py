"""Data is what its manifest says (data/verify.py): shard paths inside the dataset directory,
sizes and dtypes on every open, checksums, end-of-text ids and token ids once per shard version
(cached), and `tango-lm data verify DIR`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import tango_lm.data.verify as verify
from tango_lm.cli import main
from tango_lm.data.mixture import prepare_mixture
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.errors import UserError
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANGO_LM_CACHE", str(tmp_path / "cache"))


def copy_of(data_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(data_dir, tmp_path / "data"))


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def refused(capsys, argv: list[str]) -> str:
    rc, out, err, _ = helpers.run_main(capsys, argv)
    assert rc == 2 and out == "", (out, err)
    return helpers.assert_one_error_line(err)


def train_argv(data: Path, tmp_path: Path) -> list[str]:
    return ["train", *helpers.cli_overrides(data, tmp_path / "run", steps=2, eval_every=2, save_every=2)]


def _outside(data: Path, tmp_path: Path) -> str:
    outside = tmp_path / "outside.bin"  # the same bytes as the shard, so size and checksum agree
    shutil.copyfile(data / "train-00000.bin", outside)
    return os.path.relpath(outside, data)


def _absolute(data: Path, tmp_path: Path) -> str:
    return str(tmp_path / Path(_outside(data, tmp_path)).name)


def _symlink_out(data: Path, tmp_path: Path) -> str:
    (data / "link.bin").symlink_to(tmp_path / Path(_outside(data, tmp_path)).name)
    return "link.bin"


@pytest.mark.parametrize("where", [_outside, _absolute, _symlink_out])
def test_a_manifest_cannot_point_outside_its_directory(data_dir, tmp_path, capsys, where):
    data = copy_of(data_dir, tmp_path)
    name = where(data, tmp_path)

    def point(m):
        m["splits"]["train"]["shards"][0]["file"] = name

    edit_manifest(data, point)
    line = refused(capsys, train_argv(data, tmp_path))
    assert f"lists shard {name!r} of split 'train', which lies outside {data}" in line
    assert not (tmp_path / "run").exists()


def test_a_shard_name_with_a_nul_byte_is_a_malformed_entry(data_dir, tmp_path, capsys):
    data = copy_of(data_dir, tmp_path)

    def nul(m):
        m["splits"]["train"]["shards"][0]["file"] = "train\u0000.bin"

    edit_manifest(data, nul)
    assert "has a malformed shard entry in split 'train'" in refused(capsys, ["data", "verify", str(data)])


def test_a_manifest_without_splits_is_refused(data_dir, tmp_path, capsys):
    data = copy_of(data_dir, tmp_path)
    edit_manifest(data, lambda m: m.update(splits={}))
    assert "manifest.json lists no splits" in refused(capsys, ["data", "verify", str(data)])


def test_a_maximum_id_past_the_tokenizer_is_refused(data_dir, tmp_path, capsys):
    data = copy_of(data_dir, tmp_path)

    def past(m):
        m["max_token_id"] = 60_000  # the byte tokenizer has 257 ids

    edit_manifest(data, past)
    assert "records token id 60000, past its tokenizer's 257 ids" in refused(capsys, ["data", "verify", str(data)])


def test_a_file_listed_twice_is_refused(data_dir, tmp_path):
    data = copy_of(data_dir, tmp_path)
    edit_manifest(data, lambda m: m["splits"]["test"].update(m["splits"]["dev"]))  # test = dev
    with pytest.raises(UserError, match="lists the file 'dev-00000.bin' twice"):
        PreparedDataset.open(data)


@pytest.mark.parametrize("dtype", ["<f8", "|O", "<i8", None])
def test_dtypes_other_than_token_ids_are_refused(data_dir, tmp_path, dtype):
    data = copy_of(data_dir, tmp_path)
    edit_manifest(data, lambda m: m.update(dtype=dtype))
    with pytest.raises(UserError, match="token dtype"):
        PreparedDataset.open(data)


def test_a_shard_edited_in_place_is_refused_everywhere(data_dir, tmp_path, capsys):
    data = copy_of(data_dir, tmp_path)
    PreparedDataset.open(data)  # verified and cached while intact
    shard = data / "train-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = (ids[5] + 1) % 256
    ids.tofile(shard)
    expect = "train-00000.bin fails its sha256 checksum"
    assert expect in refused(capsys, train_argv(data, tmp_path))
    said = refused(capsys, ["data", "verify", str(data)])
    assert expect in said and said.endswith("prepare it again with `tango-lm data prepare ... --overwrite`")
    assert expect in refused(
        capsys, ["data", "prepare", "mixture", "--out", str(tmp_path / "mix"), "--source", f"{data}:1", "--no-progress"]
    )
    assert not (tmp_path / "mix").exists() and not (tmp_path / "run").exists()


def _without_end_of_text(data: Path) -> None:
    """Replace every end-of-text id of the train split by a letter and record the new checksum,
    as a careless edit would: sizes and checksums agree, the documents do not."""
    shard = data / "train-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[ids == 256] = ord("a")
    ids.tofile(shard)
    sha = hashlib.sha256(shard.read_bytes()).hexdigest()
    edit_manifest(data, lambda m: m["splits"]["train"]["shards"][0].update(sha256=sha))


def test_a_split_without_its_end_of_text_ids_is_refused(data_dir, tmp_path, capsys):
    data = copy_of(data_dir, tmp_path)
    _without_end_of_text(data)
    expect = "split 'train' of"
    assert "holds 0 end-of-text ids but the manifest records 40 documents" in refused(
        capsys, train_argv(data, tmp_path)
    )
    assert expect in refused(capsys, ["data", "verify", str(data)])
    with pytest.raises(UserError, match="end-of-text ids"):  # an IndexError before
        prepare_mixture(tmp_path / "mix", [f"{data}:1"], progress=False)


def test_token_ids_above_the_recorded_maximum_are_refused(data_dir, tmp_path):
    data = copy_of(data_dir, tmp_path)
    edit_manifest(data, lambda m: m.update(max_token_id=200))  # the shards hold EOT = 256
    with pytest.raises(UserError, match="holds token id 256, above the manifest's max_token_id 200"):
        PreparedDataset.open(data)


def test_each_shard_version_is_read_once(tmp_path):
    out = write_prepared(
        tmp_path / "d", get_tokenizer("byte"), {"train": ["abc", "de"], "dev": ["f"]}, {"name": "t"}, progress=False
    )
    assert PreparedDataset.open(out).verified["hashed"] == 0  # the writer recorded what it wrote
    assert PreparedDataset.open(out, verify=True).verified["hashed"] == 2
    shard = out / "dev-00000.bin"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # a new version...
    assert PreparedDataset.open(out).verified["hashed"] == 1  # ... is read again, and only it
    assert PreparedDataset.open(out).verified["hashed"] == 0
    shutil.rmtree(tmp_path / "cache")  # a lost cache costs one read
    assert PreparedDataset.open(out).verified["hashed"] == 2


def test_data_verify_reports_what_it_checked(data_dir, capsys):
    assert main(["data", "verify", str(data_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards"] == report["hashed"] == 3
    assert report["splits"]["train"] == {"tokens": 1280, "documents": 40}
    assert report["tokens"] == 1920 and report["documents"] == 60 and report["max_token_id"] == 256
    assert main(["data", "verify", str(data_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"verified {data_dir}: 3 shards, 1,920 tokens (train 1,280, dev 320")


def test_hashing_a_large_dataset_shows_its_progress_where_the_command_does(data_dir, tmp_path, capsys, monkeypatch):
    # A copied 100B-token dataset was hashed for minutes before a run's first line, or through all
    # of `data verify`, without a word. More than SHOWN_BYTES to read counts its tokens: as lines
    # in a log (pytest's stderr is no terminal), nothing with --no-progress or when cached.
    monkeypatch.setattr(verify, "SHOWN_BYTES", 1000)  # the copy holds 3,840 bytes
    data = copy_of(data_dir, tmp_path)
    rc, _, err, _ = helpers.run_main(capsys, [*train_argv(data, tmp_path), "train.progress=true"])
    said = [line for line in err.splitlines() if line.startswith("verify ")]
    assert rc == 0 and said[0].startswith(f"verify {data}: 1,280/1,920 tokens (67%), "), err  # the first shard
    assert said[1].startswith(f"verify {data}: 1,920/1,920 tokens (100%), ") and len(said) == 2
    assert err.index("verify ") < err.index("train tango")  # before the run's own first line
    rc, _, err, _ = helpers.run_main(capsys, ["eval", str(tmp_path / "run"), "--split", "dev"])
    assert rc == 0 and "verify " not in err  # hashed once per shard version
    rc, _, err, _ = helpers.run_main(capsys, ["data", "verify", str(data)])
    assert rc == 0 and err.startswith(f"verify {data}: 1,280/1,920 tokens (67%), ")
    rc, _, err, _ = helpers.run_main(capsys, ["data", "verify", str(data), "--no-progress"])
    assert rc == 0 and err == ""
    monkeypatch.setattr(verify, "SHOWN_BYTES", 1 << 30)
    rc, _, err, _ = helpers.run_main(capsys, ["data", "verify", str(data)])
    assert rc == 0 and err == ""  # a small one is read before a line would say anything
