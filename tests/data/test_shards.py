"""Prepared datasets: write/open round trip, corrupt datasets, atomic replacement."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tango_lm.data import shards
from tango_lm.data.dataset_dir import FORMAT
from tango_lm.data.loader import eval_batches
from tango_lm.data.sharded_tokens import ShardedTokens
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import ByteTokenizer, GPT2Tokenizer, Tokenizer
from tango_lm.errors import UserError

DOCS = {
    "train": [f"document number {i}: " + "abc " * (i % 7) for i in range(50)],
    "dev": ["short", "", "héllo wörld"],
}


def _expected(tok: Tokenizer, docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += tok.encode(d) + [tok.eot_id]
    return out


def _write(path: Path, tok: Tokenizer | None = None, **kw) -> Path:
    tok = tok or ByteTokenizer()
    kw.setdefault("shard_tokens", 100)
    return write_prepared(path, tok, {k: list(v) for k, v in DOCS.items()}, {"name": "unit"}, progress=False, **kw)


@pytest.fixture
def prepared(tmp_path) -> Path:
    return _write(tmp_path / "data")


def test_round_trip_byte(prepared):
    tok = ByteTokenizer()
    ds = PreparedDataset.open(prepared, verify=True)
    assert ds.splits == ["train", "dev"]
    assert ds.tokenizer.name == "byte"
    for split, docs in DOCS.items():
        expected = _expected(tok, docs)
        got = ds.tokens(split)
        assert got.ndim == 1 and got.dtype == np.dtype("<u2")
        assert got.tolist() == expected
        assert ds.num_tokens(split) == len(expected)
        assert ds.num_documents(split) == len(docs)
        # One EOT after each document and nowhere else.
        assert int((np.asarray(got) == tok.eot_id).sum()) == len(docs)
    m = ds.manifest
    assert m["format"] == FORMAT and m["dtype"] == "<u2" and m["source"] == {"name": "unit"}
    assert m["max_token_id"] == tok.eot_id
    train_shards = m["splits"]["train"]["shards"]
    assert len(train_shards) > 1
    assert all(s["tokens"] == 100 for s in train_shards[:-1])
    assert [s["file"] for s in train_shards[:2]] == ["train-00000.bin", "train-00001.bin"]
    assert json.loads((prepared / "tokenizer.json").read_text()) == tok.to_dict()


def test_a_split_of_several_shards_is_read_in_place_and_indexes_as_the_concatenation(prepared):
    # Several shards are a view over their memmaps (a copy per process was gigabytes at real scale).
    ds = PreparedDataset.open(prepared)
    view = ds.tokens("train")
    assert isinstance(view, ShardedTokens) and len(view.maps) > 1
    assert all(isinstance(m, np.memmap) for m in view.maps)
    whole = np.concatenate([np.asarray(m) for m in view.maps])
    n = len(whole)
    assert len(view) == n and view.shape == (n,) and view.dtype == whole.dtype and view.ndim == 1
    rng = np.random.default_rng(0)
    idx = rng.integers(-n, n, size=(7, 13))  # windows crossing shard edges, negative indices too
    assert np.array_equal(view[idx], whole[idx])
    assert np.array_equal(view[np.array([], dtype=np.int64)], whole[[]])
    for sl in (slice(95, 205), slice(None), slice(3, 3), slice(-150, None), slice(1, 250, 7)):
        assert np.array_equal(view[sl], whole[sl])
    assert view[101] == whole[101] and view[-1] == whole[-1]
    with pytest.raises(IndexError):
        view[np.array([n])]
    # the loaders' windows equal those of the concatenated array
    batches = [eval_batches(t, 16, 4) for t in (view, whole)]
    for (x1, y1), (x2, y2) in zip(*batches, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("limit", [1, 4, 9, 64])
def test_documents_longer_than_a_write_block_are_written_in_pieces_with_the_same_tokens(limit):
    # A document is written in int64 blocks of at most `limit` ids, never as one copy of itself:
    # one 300 MB document with no separator took 6 GB as a whole.
    encoded = [[5] * 30, [], [1, 2, 3], list(range(10)), [7]]
    blocks = list(shards._token_blocks(encoded, 99, limit))
    assert np.concatenate(blocks).tolist() == [t for ids in encoded for t in [*ids, 99]]
    assert max(len(b) for b in blocks) <= max(limit, 1)


def test_the_dataset_written_in_small_blocks_is_the_same(tmp_path, monkeypatch):
    whole = _write(tmp_path / "whole")
    monkeypatch.setattr(shards, "_BLOCK_TOKENS", 7)  # every train document is longer
    pieces = _write(tmp_path / "pieces")
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (pieces, whole)]
    for manifest in manifests:  # the second may tick between the two writes
        del manifest["created"]
    assert manifests[0] == manifests[1]
    for split in DOCS:
        assert PreparedDataset.open(pieces).tokens(split).tolist() == _expected(ByteTokenizer(), DOCS[split])


def test_round_trip_gpt2_single_shard_is_memmap(tmp_path):
    tok = GPT2Tokenizer()
    path = _write(tmp_path / "g", tok, shard_tokens=2**20)
    ds = PreparedDataset.open(path)
    assert isinstance(ds.tokens("train"), np.memmap)
    assert ds.tokens("train").tolist() == _expected(tok, DOCS["train"])
    assert ds.tokenizer.encode("Hello world") == [15496, 995]


def test_large_vocab_uses_uint32(tmp_path, monkeypatch):
    class Wide(ByteTokenizer):
        """Byte ids shifted past 2**16 (end-of-text stays the byte tokenizer's, as recorded)."""

        def __init__(self) -> None:
            super().__init__()
            self.vocab_size = 70_000

        def encode_batch(self, texts):
            return [[i + 69_000 for i in ids] for ids in super().encode_batch(texts)]

        def to_dict(self):
            return ByteTokenizer().to_dict()  # a real tokenizer's record; opening rebuilds a Wide (below)

    path = write_prepared(tmp_path / "w", Wide(), {"train": ["ab"]}, {}, progress=False)
    monkeypatch.setattr(shards, "tokenizer_from_dict", lambda d: Wide())  # its 70,000 ids hold the shards' ids
    ds = PreparedDataset.open(path, verify=True)
    assert ds.manifest["dtype"] == "<u4"
    assert ds.tokens("train").tolist() == [69_097, 69_098, 256]
    assert ds.max_token_id == 69_098


def test_unknown_split_lists_available(prepared):
    ds = PreparedDataset.open(prepared)
    with pytest.raises(UserError, match="'test'.*available splits: train, dev"):
        ds.tokens("test")


def test_missing_directory(tmp_path):
    with pytest.raises(
        UserError, match=r"no prepared dataset at .*nowhere \(directory missing\).*tango-lm data prepare"
    ):
        PreparedDataset.open(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")  # said "directory missing" too
    with pytest.raises(UserError, match=r"no prepared dataset at .*afile \(a file, not a directory\)"):
        PreparedDataset.open(tmp_path / "afile")


@pytest.mark.parametrize(
    "name, hint",
    [
        ("dmmath-gpt2", "`tango-lm data prepare dmmath --out {path} --tokenizer gpt2`"),  # the TANGO presets' data.dir
        ("dmmath-byte", "`tango-lm data prepare dmmath --out {path} --tokenizer byte`"),  # the CPU sweeps'
        (
            "climbmix-gpt2",
            "`tango-lm data prepare SOURCE --out {path} ...` (`tango-lm data prepare --help` lists them)",
        ),
    ],
)
def test_a_missing_dataset_names_the_command_that_makes_it(tmp_path, name, hint):
    # `tango-lm train tango-70m-d4` on a new machine said "run `tango-lm data prepare ...`": which source?
    path = tmp_path / "data" / name
    with pytest.raises(UserError) as err:
        PreparedDataset.open(path)
    assert str(err.value).endswith("; create it with " + hint.format(path=path))


def test_missing_manifest(prepared):
    (prepared / "manifest.json").unlink()
    with pytest.raises(UserError, match="has no manifest.json"):
        PreparedDataset.open(prepared)


def test_unparseable_manifest(prepared):
    (prepared / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot be parsed"):
        PreparedDataset.open(prepared)


def test_wrong_format_tag(prepared):
    m = json.loads((prepared / "manifest.json").read_text())
    m["format"] = "something-else/9"
    (prepared / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="format 'something-else/9', expected 'tango-lm-shards/1'"):
        PreparedDataset.open(prepared)


def test_missing_shard(prepared):
    (prepared / "train-00001.bin").unlink()
    with pytest.raises(UserError, match="shard train-00001.bin of split 'train' is missing"):
        PreparedDataset.open(prepared)


def test_truncated_shard(prepared):
    f = prepared / "dev-00000.bin"
    f.write_bytes(f.read_bytes()[:-2])
    with pytest.raises(UserError, match="dev-00000.bin has .* bytes but the manifest says"):
        PreparedDataset.open(prepared)


def test_a_shard_edited_in_place_fails_its_checksum(prepared):
    PreparedDataset.open(prepared)  # verified once (and cached) ...
    f = prepared / "train-00000.bin"
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    f.write_bytes(bytes(data))  # ... then edited: the sizes still match, the version does not
    with pytest.raises(UserError, match="train-00000.bin fails its sha256 checksum"):
        PreparedDataset.open(prepared)


def test_existing_dataset_needs_overwrite(prepared):
    with pytest.raises(
        UserError, match=r"already holds a prepared dataset; pass --overwrite \(overwrite=True in Python\)"
    ):
        _write(prepared)
    write_prepared(prepared, ByteTokenizer(), {"train": ["new"]}, {"v": 2}, progress=False, overwrite=True)
    ds = PreparedDataset.open(prepared, verify=True)
    assert ds.splits == ["train"] and ds.source == {"v": 2}
    assert not (prepared / "train-00001.bin").exists()  # nothing left over from the old dataset
    assert _leftovers(prepared) == []


def test_overwrite_refuses_a_dataset_directory_holding_other_files(prepared):
    """--overwrite replaces the dataset's directory whole: files the user put there stop it."""
    before = _snapshot(prepared)
    (prepared / "results-00001.bin").write_bytes(b"mine")  # named like a shard, but none the manifest lists
    with pytest.raises(UserError, match=r"holds results-00001\.bin beside the prepared dataset"):
        write_prepared(prepared, ByteTokenizer(), {"train": ["new"]}, {}, progress=False, overwrite=True)
    (prepared / "results-00001.bin").unlink()
    (prepared / "NOTES.md").write_text("mine")
    with pytest.raises(UserError, match=r"holds NOTES\.md beside the prepared dataset; .* move it out first"):
        write_prepared(prepared, ByteTokenizer(), {"train": ["new"]}, {}, progress=False, overwrite=True)
    for name in ("a", "b", "c"):
        (prepared / f"{name}.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds NOTES\.md, a\.json, b\.json and 1 more beside .* move them out"):
        write_prepared(prepared, ByteTokenizer(), {"train": ["new"]}, {}, progress=False, overwrite=True)
    assert {k: v for k, v in _snapshot(prepared).items() if k in before} == before


@pytest.mark.parametrize(
    "splits",
    [
        ["train"],
        {"train": ["train-00000.bin"]},
        {"train": {"shards": "train-00000.bin"}},
        {"train": 3},
        {"train": {"shards": ["train-00000.bin"]}},
        {"train": {"shards": [None]}},
    ],
)
def test_overwrite_replaces_a_dataset_whose_manifest_is_damaged(prepared, splits):
    """`data verify` answers a damaged manifest by sending its user to --overwrite, which met the
    damage with an AttributeError: the shards it wrote are known by their names too."""
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["splits"] = splits
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    write_prepared(prepared, ByteTokenizer(), {"train": ["new"]}, {"v": 2}, progress=False, overwrite=True)
    assert PreparedDataset.open(prepared, verify=True).source == {"v": 2}


def test_refuses_foreign_directory(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="exists and is not a prepared dataset"):
        _write(other, overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith("."))


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_crash_midway_leaves_existing_dataset_untouched(prepared):
    before = _snapshot(prepared)

    def exploding_docs():
        yield "first"
        yield "second"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_prepared(
            prepared,
            ByteTokenizer(),
            {"train": exploding_docs()},
            {},
            progress=False,
            overwrite=True,
            batch_docs=1,
            shard_tokens=4,
        )
    assert _snapshot(prepared) == before
    assert _leftovers(prepared) == []
    PreparedDataset.open(prepared, verify=True)


def test_crash_in_final_rename_restores_existing(prepared, monkeypatch):
    before = _snapshot(prepared)
    real_rename = os.rename

    def failing_rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        return real_rename(src, dst)

    monkeypatch.setattr(shards.os, "rename", failing_rename)
    with pytest.raises(UserError, match="rename failed; nothing was written or replaced"):
        _write(prepared, overwrite=True)
    monkeypatch.undo()
    assert _snapshot(prepared) == before
    assert _leftovers(prepared) == []


def test_crash_without_existing_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("tokenizer crashed")

    monkeypatch.setattr(ByteTokenizer, "encode_batch", boom)
    with pytest.raises(RuntimeError):
        _write(tmp_path / "fresh")
    assert list(tmp_path.iterdir()) == []
