"""DeepMind Mathematics: generator environment, splits, determinism and the generation cache.

The generator's environment lives in the default cache (created once, ~15-60 s, needs PyPI);
each test run generates a tiny fresh set in a temporary directory.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tango_lm.data import dmmath
from tango_lm.data.shards import PreparedDataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _documents(ds: PreparedDataset, split: str) -> list[str]:
    tokens = np.asarray(ds.tokens(split))
    ends = np.flatnonzero(tokens == ds.tokenizer.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ds.tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("dmmath-cache")
    mp = pytest.MonkeyPatch()
    mp.setattr(dmmath, "_generated_root", lambda: root)
    out = tmp_path_factory.mktemp("prepared") / "dmmath"
    path = dmmath.prepare_dmmath(
        out, train_per_module=3, test_per_module=1, workers=2, include_extrapolate=True, progress=False
    )
    yield path, root, mp
    mp.undo()


def test_splits_exist_and_look_like_problems(generated):
    path, _, _ = generated
    ds = PreparedDataset.open(path, verify=True)
    assert ds.splits == ["train", "dev", "test", "extrapolate"]
    assert ds.tokenizer.name == "gpt2"
    src = ds.source
    assert src["name"] == "dmmath" and src["train_per_module"] == 3 and src["test_modules"] == 56
    for split in ds.splits:
        docs = _documents(ds, split)
        assert len(docs) == ds.num_documents(split) > 0
        assert all(len(d.split("\n")) >= 2 and d.split("\n")[-1] for d in docs)  # question \n answer


def test_dev_is_held_out_from_train(generated):
    path, _, _ = generated
    ds = PreparedDataset.open(path)
    train, dev, test = (set(_documents(ds, s)) for s in ("train", "dev", "test"))
    assert dev and train
    assert not train & dev
    assert not train & test and not dev & test
    # 3 examples for each of the 56 train modules, split between train and dev.
    assert ds.num_documents("train") + ds.num_documents("dev") <= 3 * 56
    assert ds.num_documents("dev") == 56


@pytest.mark.parametrize(
    ("n", "fraction", "dev"), [(300, 0.05, 15), (3, 0.05, 1), (40, 0.05, 2), (2, 0.9, 1), (3, 0.0, 0), (1, 0.5, 0)]
)
def test_dev_takes_the_rounded_share_of_a_module_but_at_least_one_and_never_all(n, fraction, dev):
    import random

    train, held = dmmath._hold_out([f"q{i}" for i in range(n)], fraction, random.Random(0))
    assert len(held) == dev and len(train) == n - dev and not set(train) & set(held)


def test_test_split_is_interpolate_with_56_modules(generated):
    path, root, _ = generated
    ds = PreparedDataset.open(path)
    cache = root / ds.source["cache_key"]
    files = sorted(cache.glob("interpolate__*.jsonl"))
    assert len(files) == 56
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert {r["split"] for r in rows} == {"interpolate"}
    assert len({r["module"] for r in rows}) == 56
    assert "algebra__linear_1d" in {r["module"] for r in rows}
    assert sorted(_documents(ds, "test")) == sorted(r["question"] + "\n" + r["answer"] for r in rows)
    assert len(list(cache.glob("extrapolate__*.jsonl"))) == 15
    for difficulty in ("train-easy", "train-medium", "train-hard"):
        assert len(list(cache.glob(f"{difficulty}__*.jsonl"))) == 56


def test_second_prepare_uses_cache(generated, tmp_path, monkeypatch):
    path, _, _ = generated

    def no_subprocess(*args, **kwargs):
        raise AssertionError("the generator must not run again")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    again = dmmath.prepare_dmmath(
        tmp_path / "again",
        train_per_module=3,
        test_per_module=1,
        workers=2,
        include_extrapolate=True,
        progress=False,
    )
    a, b = PreparedDataset.open(path), PreparedDataset.open(again)
    for split in a.splits:
        assert np.array_equal(a.tokens(split), b.tokens(split))


def test_generation_is_deterministic(generated, tmp_path, monkeypatch):
    path, root, _ = generated
    monkeypatch.setattr(dmmath, "_generated_root", lambda: tmp_path)
    # One process instead of two: the results must not depend on which process ran which module.
    fresh = dmmath.generate_examples(0, {"interpolate": 1}, workers=1, progress=False)
    key = PreparedDataset.open(path).source["cache_key"]
    for f in sorted(fresh.glob("interpolate__*.jsonl")):
        assert f.read_text() == (root / key / f.name).read_text(), f.name


def test_bad_parameters_are_user_errors(tmp_path):
    from tango_lm.errors import UserError

    with pytest.raises(UserError, match="dev_fraction"):
        dmmath.prepare_dmmath(tmp_path / "x", dev_fraction=1.5)
    with pytest.raises(UserError, match="unknown tokenizer"):
        dmmath.prepare_dmmath(tmp_path / "x", tokenizer="nope")


def _fake_run(fail_pip: bool, calls: list):
    def run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (dmmath.Path(cmd[3]) / "bin").mkdir(parents=True)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if fail_pip:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_env_install_failure_is_user_error_and_leaves_nothing(tmp_path, monkeypatch):
    from tango_lm.errors import UserError

    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_run(True, calls))
    env = tmp_path / "dmmath-env"
    with pytest.raises(UserError, match=r"at .*dmmath-env: pip install failed .ERROR: No matching"):
        dmmath.ensure_generator_env(env)
    assert list(tmp_path.iterdir()) == []


def test_env_is_built_once_and_rebuilt_without_marker(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_run(False, calls))
    env = tmp_path / "dmmath-env"
    assert dmmath.ensure_generator_env(env) == env / "bin" / "python"
    assert len(calls) == 2 and json.loads((env / "tango-lm-env.json").read_text())["requirements"]
    dmmath.ensure_generator_env(env)
    assert len(calls) == 2  # reused
    (env / "tango-lm-env.json").unlink()  # as if an install had been interrupted
    dmmath.ensure_generator_env(env)
    assert len(calls) == 4 and (env / "tango-lm-env.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dmmath-env"]
