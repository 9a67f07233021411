"""`tango-lm eval --ppl` (eval/perplexity.py) scores windows of the run's training sequence length,
not the model's (longer) context, and reports the stride it used.

Destination: tests/eval/test_perplexity_window.py."""

from __future__ import annotations

import json

import pytest
import torch

from tango_lm.cli import main
from tango_lm.data.tokenizers import ByteTokenizer
from tango_lm.eval.perplexity import document_perplexity, evaluate_checkpoint_file
from tango_lm.train.checkpoint import save_checkpoint
from tango_lm.train.config import RunConfig
from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "the quick brown fox jumps over the lazy dog and then some more text to score " * 2


@pytest.fixture(scope="module")
def short_trained(tmp_path_factory):
    """A checkpoint of context 32 that trained windows of 16 (train.seq_len), weights off their init."""
    root = tmp_path_factory.mktemp("seq16")
    run = RunConfig.from_dict(
        {
            "model": {**helpers.TINY_MODEL, "init_std": 0.3},
            "data": {"dir": str(root / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(root), "seq_len": 16},
        }
    )
    torch.manual_seed(0)
    net = run.model.build()
    tok = ByteTokenizer()
    ckpt = save_checkpoint(root / "checkpoints", 1, net.state_dict(), {}, run.to_dict(), tok.to_dict(), {})
    (root / "t.txt").write_text(TEXT + "\n")
    return ckpt, net.eval(), root / "t.txt"


def test_ppl_windows_are_the_trained_sequence_length(short_trained):
    ckpt, net, path = short_trained
    res = evaluate_checkpoint_file(str(ckpt), path, "text", device="cpu")
    assert res["context"] == 16 and res["stride"] == 16
    want = document_perplexity(net, ByteTokenizer(), [TEXT], 16)
    other = document_perplexity(net, ByteTokenizer(), [TEXT], 32)
    assert res["nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert abs(want["nll"] - other["nll"]) > 1e-4  # the window length matters to the number


def test_the_reported_stride_defaults_to_the_window(short_trained, capsys):
    _, net, path = short_trained
    res = document_perplexity(net, ByteTokenizer(), [TEXT], 16)
    assert res["stride"] == 16 and res["context"] == 16
    assert document_perplexity(net, ByteTokenizer(), [TEXT], 16, stride=4)["stride"] == 4
    assert main(["eval", str(short_trained[0]), "--ppl", str(path), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stride"] == 16
