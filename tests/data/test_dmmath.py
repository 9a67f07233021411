"""DeepMind Mathematics: generator environment, splits, determinism and the generation cache.

The generator's environment lives in the default cache (created once, ~15-60 s, needs PyPI);
each test run generates a tiny fresh set in a temporary directory.
"""

from __future__ import annotations

import importlib.util
import json
import operator
import random
import subprocess
import sys

import numpy as np
import pytest

from tango_lm.data import dmmath
from tango_lm.data.shards import PreparedDataset
from tests import helpers

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


def _import(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_gets_numpy_1_26_4_where_it_has_wheels_and_numpy_2_after():
    # numpy 1.26.4 has no wheel for Python 3.13 (pip built it from source, 6 minutes) or 3.14 (none).
    assert dmmath.generator_requirements((3, 11))[0] == dmmath.generator_requirements((3, 12))[0] == "numpy==1.26.4"
    assert dmmath.generator_requirements((3, 13))[0] == dmmath.generator_requirements((3, 14))[0] == "numpy==2.5.5"
    assert dmmath.REQUIREMENTS == dmmath.generator_requirements(sys.version_info[:2])


def test_the_worker_gives_randint_integral_floats_as_python_3_11_did_drawing_the_same_numbers():
    # The generator's numbers.round_number passes floats to random.randint; Python 3.12 refuses
    # them (TypeError), which stopped `make quickstart` on Python 3.12 and later.
    worker = _import(dmmath.WORKER, "dmmath_worker_under_test")

    class Python312(random.Random):  # randrange as 3.12 has it: integers only
        def randrange(self, start, stop=None, step=1):
            index = operator.index
            return super().randrange(index(start), None if stop is None else index(stop), index(step))

    class Shimmed(Python312):
        randrange = worker._randrange_taking_integral_floats(Python312.randrange)

    with pytest.raises(TypeError):
        Python312(7).randint(2.0, 9.0)
    shimmed, plain = Shimmed(7), random.Random(7)
    assert [shimmed.randint(-3.0, 40.0) for _ in range(50)] == [plain.randint(-3, 40) for _ in range(50)]
    assert [shimmed.randrange(10.0) for _ in range(20)] == [plain.randrange(10) for _ in range(20)]
    assert [shimmed.randrange(0.0, 30.0, 5.0) for _ in range(20)] == [plain.randrange(0, 30, 5) for _ in range(20)]
    with pytest.raises(ValueError, match="non-integer arg 1"):
        shimmed.randint(1.5, 4)
    with pytest.raises(ValueError, match="non-integer arg 2"):
        shimmed.randrange(1, 4.5)


def test_the_worker_rewrites_the_itemset_calls_numpy_2_removed(tmp_path):
    worker = _import(dmmath.WORKER, "dmmath_worker_under_test")
    fill = (
        "import numpy as np\n\n\ndef fill(index, value):\n    a = np.zeros((2, 3), dtype=np.int64)\n"
        "    a.itemset(index, value)\n    return a\n\n\ndef fill_object(index, items):\n"
        "    b = np.empty((2, 2), dtype=object)\n    b.itemset(index, items)\n    return b\n"
    )
    (tmp_path / "uses_itemset.py").write_text(fill)
    module = _import(tmp_path / "uses_itemset.py", "uses_itemset")
    if not hasattr(np.ndarray, "itemset"):
        with pytest.raises(AttributeError):
            module.fill((1, 2), 5)
    worker._rewrite_itemset(module)
    assert module.fill((1, 2), 5).tolist() == [[0, 0, 0], [0, 0, 5]]
    assert module.fill_object((0, 1), [1, 2])[0, 1] == [1, 2]  # the list is the element
    (tmp_path / "one_call.py").write_text(fill.split("\n\n\ndef fill_object")[0] + "\n")
    with pytest.raises(RuntimeError, match="expected 2 calls of ndarray.itemset in .*one_call.py, found 1"):
        worker._rewrite_itemset(_import(tmp_path / "one_call.py", "one_call"))


def test_compare_generators_tool_finds_an_interpreter_agreeing_with_itself(generated, tmp_path):
    # docs/benchmarks.md's comparison of Pythons, end to end on this one (its environment borrowed).
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "python{}.{}".format(*sys.version_info[:2])).symlink_to(dmmath.ensure_generator_env().parent.parent)
    script = helpers.TOOLS / "compare_dmmath_generators.py"
    argv = [sys.executable, script, sys.executable, sys.executable, "--per-module", "1", "--envs", envs]
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    header, reference, other = proc.stdout.splitlines()
    assert header.split()[:5] == ["interpreter", "python", "numpy", "problems", "seconds"]
    assert reference.endswith("(the reference)") and other.endswith(" 0")
    assert reference.split()[3] == other.split()[3] == "239"  # 56 modules x 3 difficulties, 56 + 15 tests
    differing = helpers.tool("compare_dmmath_generators").differing
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name, a, b in (("same", "x", "x"), ("changed", "x", "y")):
        (tmp_path / "a" / name).write_text(a)
        (tmp_path / "b" / name).write_text(b)
    (tmp_path / "a" / "only-a").write_text("x")
    assert differing(tmp_path / "a", tmp_path / "b") == ["changed", "only-a"]
