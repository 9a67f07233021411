"""The onóna paper's validation protocol (seed 001, Appendix C): every arm scores the same 1,024
held-out windows sampled with seed 1234, in batches of eight, every 500 steps and at the final step.
`train.eval_sample_seed` samples the dev windows (data/loader.py `eval_window_ids`, a pure function
of seed, window count and sample size; the 2-rank check is in test_distributed.py) and
`train.eval_batch_size` fixes the batch each evaluation forward sees (it matters for MoE, whose
validation capacity of 1.25 drops tokens per call)."""

from __future__ import annotations

import json
import shutil

import pytest

from tango_lm.cli import main
from tango_lm.data.loader import eval_window_ids
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.errors import UserError
from tango_lm.eval.evaluate import evaluate_checkpoint
from tango_lm.train.checkpoint import load_checkpoint, resolve_run_checkpoint
from tango_lm.train.config import TrainConfig, load_run_config
from tango_lm.train.trainer import Trainer, train
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

ONONA_PRESETS = [f"{arch}-{size}" for arch in ("dense", "gdn-hybrid", "moe", "attnres") for size in ("142m", "330m")]
SAMPLED = {"eval_sample_seed": 1234, "eval_windows": 5, "eval_batch_size": 3}  # 5 of the 9 dev windows


def _ids(batches) -> list[int]:
    """Window ids of evaluation batches (byte tokens of the synthetic data: window i starts at 32 i)."""
    return [int(i) for inputs, _ in batches for i in inputs[:, :1].flatten()]


def test_defaults_are_the_first_windows_with_the_training_batch():
    cfg = TrainConfig()
    assert cfg.eval_sample_seed is None and cfg.eval_batch_size is None


def test_trainer_scores_the_sampled_windows_in_batches_of_eval_batch_size(data_dir, tmp_path):
    dev = PreparedDataset.open(data_dir).tokens("dev")
    sampled = Trainer(helpers.run_config(data_dir, tmp_path / "a", **SAMPLED)).dev_batches
    first = Trainer(helpers.run_config(data_dir, tmp_path / "b", eval_windows=5, eval_batch_size=3)).dev_batches
    assert [len(x) for x, _ in sampled] == [3, 2]
    want = eval_window_ids(9, 5, sample_seed=1234).tolist()
    assert want != [0, 1, 2, 3, 4]
    assert _ids(sampled) == [int(dev[32 * i]) for i in want]
    assert _ids(first) == [int(dev[32 * i]) for i in range(5)]  # no seed: today's first windows


def test_eval_of_a_sampled_run_reproduces_its_logged_dev_nll(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, eval_every=4, save_every=4, **SAMPLED))
    logged = helpers.dev_records(out)[-1]["dev_nll"]
    res = evaluate_checkpoint(str(out), "dev")  # the run's 5 sampled windows, not all 9 in order
    assert res["sample_seed"] == 1234 and res["tokens"] == 5 * 32
    assert res["nll"] == pytest.approx(logged, rel=1e-6)
    assert evaluate_checkpoint(str(out), "dev", max_windows=9)["nll"] != pytest.approx(logged, rel=1e-6)
    assert "sample_seed" not in evaluate_checkpoint(str(out), "test")  # the test split is not sampled
    assert main(["eval", str(out), "--split", "dev"]) == 0
    assert "windows sampled with seed 1234" in capsys.readouterr().out


def test_eval_of_a_run_that_tests_on_its_dev_split_reproduces_its_test_nll(data_dir, tmp_path, capsys):
    # With data.test_split: dev, `--split test` matched the split by name, took the dev role's
    # sampled eval windows and printed another number than the summary's test NLL.
    out = tmp_path / "run"
    run = helpers.run_config(data_dir, out, steps=4, eval_every=4, save_every=4, test_windows=7, **SAMPLED)
    run.data.test_split = "dev"
    train(run)
    summary = json.loads((out / "summary.json").read_text())
    res = evaluate_checkpoint(str(out), "test")
    assert res["tokens"] == summary["test_tokens"] == 7 * 32 and "sample_seed" not in res
    assert res["nll"] == pytest.approx(summary["test_nll"], rel=1e-6) and res["role"] == "test"
    assert main(["eval", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"test ('dev') NLL {summary['test_nll']:.4f} nats/token over 224 tokens")
    dev = evaluate_checkpoint(str(out), "dev")
    assert (
        "role" not in dev
        and dev["sample_seed"] == 1234
        and dev["nll"] == pytest.approx(helpers.dev_records(out)[-1]["dev_nll"], rel=1e-6)
    )


def test_eval_with_the_runs_own_data_named_scores_the_runs_windows(data_dir, tmp_path, capsys):
    # `--data` naming the run's own dataset scored every dev window (a number the log never shows)
    # while the output said "windows sampled with seed 1234"; every window is no sample.
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, eval_every=4, save_every=4, **SAMPLED))
    logged = helpers.dev_records(out)[-1]["dev_nll"]
    res = evaluate_checkpoint(str(out), "dev", data_dir=str(data_dir))
    assert res["nll"] == pytest.approx(logged, rel=1e-6) and res["sample_seed"] == 1234
    every = evaluate_checkpoint(str(out), "dev", max_windows="all")
    assert every["tokens"] == 9 * 32 and "sample_seed" not in every
    # more windows asked than the split has: every one is scored, and that is no sample either
    assert "sample_seed" not in evaluate_checkpoint(str(out), "dev", max_windows=100)
    # 0 said the split was shorter than one window, 2.5 scored 2 windows, "ALL" raised a ValueError
    for bad in (0, -1, 2.5, "ALL", True):
        with pytest.raises(UserError, match=r"max_windows must be a whole number of at least 1, 'all' or None"):
            evaluate_checkpoint(str(out), "dev", max_windows=bad)


def test_eval_knows_the_runs_data_by_its_tokens_and_says_to_pass_data_when_it_is_not_found(
    data_dir, tmp_path, monkeypatch
):
    # It said only "no prepared dataset at data", not that the path is the run's, relative, or --data.
    monkeypatch.chdir(data_dir.parent)
    out = tmp_path / "run"
    train(helpers.run_config(data_dir.name, out, steps=2, eval_every=2, save_every=2))
    logged = helpers.dev_records(out)[-1]["dev_nll"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError,
        match=rf"the run's dataset {data_dir.name} \(its data.dir\) is not under {tmp_path}; "
        "run from the folder it trained in, or pass --data DIR",
    ):
        evaluate_checkpoint(str(out), "dev")
    # --data naming the run's dataset from here, or a copy of it elsewhere, scores the run's own
    # windows (the logged dev NLL), as the tokens the checkpoint recorded say it is the run's data
    copy = tmp_path / "moved"
    shutil.copytree(data_dir, copy)
    for named in (data_dir, copy):
        assert evaluate_checkpoint(str(out), "dev", data_dir=str(named))["nll"] == pytest.approx(logged, rel=1e-6)
    other = tmp_path / "other"  # the same tokenizer and sizes, other dev text: every window is scored
    docs = {"train": helpers.make_docs(helpers.TRAIN_DOCS, 0), "dev": helpers.make_docs(helpers.EVAL_DOCS, 5)}
    write_prepared(other, get_tokenizer("byte"), {**docs, "test": docs["dev"]}, {"name": "other"}, progress=False)
    assert evaluate_checkpoint(str(out), "dev", data_dir=str(other))["tokens"] == 9 * 32
    config = json.loads((out / "config.json").read_text())
    config["data"]["dir"] = str(tmp_path / "gone")
    step = out / "checkpoints" / "step-00000002"
    helpers.rewrite_step_json(step, "config.json", config)
    with pytest.raises(UserError, match="is gone; prepare it again, or pass --data DIR"):
        evaluate_checkpoint(str(step), "dev")


def test_eval_of_a_run_whose_dataset_was_prepared_again_is_refused(data_dir, tmp_path, capsys):
    # It scored the new tokens as the run's own windows and called them its dev or test NLL.
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    out = tmp_path / "run"
    train(helpers.run_config(data, out, steps=2, eval_every=2, save_every=2))
    docs = {"train": helpers.make_docs(helpers.TRAIN_DOCS, 3), "dev": helpers.make_docs(helpers.EVAL_DOCS, 4)}
    write_prepared(data, get_tokenizer("byte"), {**docs, "test": docs["dev"]}, {}, progress=False, overwrite=True)
    capsys.readouterr()
    assert main(["eval", str(out), "--split", "test"]) == 2
    said = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "holds other tokens than the run trained on (prepared again since); prepare it as it was" in said
    res = evaluate_checkpoint(str(out), "dev", data_dir=str(data))  # named: that data, every window
    assert res["tokens"] == (PreparedDataset.open(data).num_tokens("dev") - 1) // 32 * 32 and "sample_seed" not in res
    # only the split scored counts: more training text, the same test split, is still the run's test NLL
    kept = {
        "dev": helpers.make_docs(helpers.EVAL_DOCS, 1),
        "test": helpers.make_docs(helpers.EVAL_DOCS, 2),
    }  # data_dir's
    logged = json.loads((out / "summary.json").read_text())["test_nll"]
    write_prepared(data, get_tokenizer("byte"), {"train": docs["train"], **kept}, {}, progress=False, overwrite=True)
    assert evaluate_checkpoint(str(out), "test")["nll"] == pytest.approx(logged, rel=1e-6)


def test_another_tokenizer_of_the_same_name_is_told_apart(data_dir, tmp_path):
    # Two trained BPEs are both 'bpe': "prepared with tokenizer 'bpe', not the checkpoint's 'bpe'".
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=2, eval_every=2, save_every=2))
    step = helpers.step_dir(out, 2)
    tokenizer = json.loads((step / "tokenizer.json").read_text())
    helpers.rewrite_step_json(step, "tokenizer.json", {**tokenizer, "fingerprint": "f" * 64})
    with pytest.raises(UserError, match=r"tokenizer 'byte' \(\w{12}, 257 ids\), not the checkpoint's 'byte' \(ffffff"):
        evaluate_checkpoint(str(step), "dev")


def test_eval_batch_size_sets_what_one_moe_call_sees(data_dir, tmp_path):
    # MoE drops tokens over capacity per forward call, so the dev NLL depends on the batch: the
    # protocol fixes it (batches of 8 in the paper) instead of inheriting the training batch.
    moe = {"arch": "moe", "head_dim": 8, "width": 32, "moe_expert_width": 8, "n_kv_heads": 2}
    nll = {}
    for bs in (1, 4):
        out = tmp_path / f"bs{bs}"
        train(
            helpers.run_config(
                data_dir, out, moe, steps=2, eval_every=2, save_every=2, eval_windows=8, eval_batch_size=bs
            )
        )
        nll[bs] = helpers.dev_records(out)[-1]["dev_nll"]
        assert evaluate_checkpoint(str(out), "dev", max_windows=8)["nll"] == pytest.approx(nll[bs], rel=1e-6)
    assert nll[1] != pytest.approx(nll[4], rel=1e-6)


@pytest.mark.parametrize("name", ONONA_PRESETS)
def test_onona_presets_follow_the_papers_protocol(name):
    train_cfg = load_run_config(name, []).train
    assert (train_cfg.eval_every, train_cfg.eval_windows, train_cfg.eval_sample_seed, train_cfg.eval_batch_size) == (
        500,
        1024,
        1234,
        8,
    )
    assert train_cfg.select == "final"
    assert not train_cfg.reshuffle_each_epoch  # Appendix C: the same permutation on every pass


def test_dense_1b_follows_its_separate_evaluation():
    # The 1B runs' own setting (Appendix C): 50 batches of the training micro-batch (8), sampled
    # with a fixed seed, so 400 windows; the seed's value is not stated (1234, the primary one).
    train_cfg = load_run_config("dense-1b", []).train
    assert (train_cfg.eval_windows, train_cfg.eval_batch_size, train_cfg.eval_sample_seed) == (50 * 8, 8, 1234)
    assert train_cfg.batch_size // 8 == train_cfg.eval_batch_size  # 8 GPUs: the per-GPU micro-batch


def test_eval_scores_in_the_batches_its_run_used_on_several_processes(data_dir, tmp_path, monkeypatch):
    # N processes score batch_size / N windows per forward; eval scored batch_size, and MoE's dev
    # NLL (capacity per forward) then differed from the logged one.
    import json

    from tango_lm.eval import evaluate

    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=2, eval_every=2, save_every=2, batch_size=4))
    meta_path = next((out / "checkpoints").glob("step-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "parallel": "ddp", "world_size": 2}))  # as 2 ranks write it
    seen = []
    real = evaluate.eval_batches
    monkeypatch.setattr(
        evaluate, "eval_batches", lambda tokens, t, bs, *a, **k: seen.append(bs) or real(tokens, t, bs, *a, **k)
    )
    evaluate_checkpoint(str(out), "dev", max_windows=4)
    assert seen == [2]


def test_the_summary_gives_the_selected_checkpoints_dev_nll(data_dir, tmp_path, monkeypatch):
    # select: final tests the final checkpoint; the table showed the best dev NLL beside its test NLL.
    script = {2: 3.0, 4: 2.0, 6: 2.5}
    monkeypatch.setattr(Trainer, "evaluate_dev", lambda self: script[self.step])
    for select, want in (("final", 2.5), ("best", 2.0)):
        result = train(
            helpers.run_config(data_dir, tmp_path / select, steps=6, eval_every=2, save_every=2, select=select)
        )
        assert (result.summary["selected_dev_nll"], result.summary["best_dev_nll"]) == (want, 2.0)


def test_eval_of_a_run_dir_follows_settings_a_resume_changed(data_dir, tmp_path):
    # A resume of a finished run with other test_windows or select writes no checkpoint: `eval RUN`
    # read both from the selected checkpoint's config.json (the old settings), so it no longer
    # reproduced the test NLL the run reported, and served the old selection.
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=4, eval_every=2, save_every=2, keep_last=3, test_windows=2))
    train(helpers.run_config(data_dir, out, steps=4, eval_every=2, save_every=2, keep_last=3, test_windows=5), True)
    summary = json.loads((out / "summary.json").read_text())
    res = evaluate_checkpoint(str(out), "test")
    assert (res["nll"], res["tokens"]) == (pytest.approx(summary["test_nll"], rel=1e-6), summary["test_tokens"])
    assert res["tokens"] == 5 * 32
    kwargs = dict(steps=4, eval_every=2, save_every=2, keep_last=3, test_windows=5, select="final")
    train(helpers.run_config(data_dir, out, **kwargs), True)
    (out / "best.json").write_text(json.dumps({"step": 2, "dev_nll": 0.5}))  # a best before the last step
    assert resolve_run_checkpoint(out) == helpers.step_dir(out, 4)
    assert load_checkpoint(out).meta["step"] == 4
