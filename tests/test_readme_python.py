"""The README's Python blocks run as written and do what their comments say."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests import helpers

pytestmark = pytest.mark.usefixtures("one_thread")


def readme_python_blocks() -> list[str]:
    section = (helpers.ROOT / "README.md").read_text().split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_model_block_builds_scores_and_decodes_with_a_cache():
    model_block = readme_python_blocks()[0]
    scope: dict = {}
    exec(compile(model_block, "README.md (Python: the model)", "exec"), scope)
    assert scope["log_probs"].shape == (2, 128, 50257)
    assert torch.allclose(scope["log_probs"].exp().sum(-1), torch.ones(2, 128), atol=1e-4)  # normalized
    assert set(scope["cfg"].num_params()) == {"total", "non_embedding", "embedding"}
    full = scope["model"](scope["ids"][:, :11])  # the cached step predicts as the full forward
    torch.testing.assert_close(scope["nxt"][:, -1], full[:, 10], rtol=0, atol=1e-4)


def test_the_training_block_trains_the_run_the_command_would(tmp_path, monkeypatch):
    from tango_lm.data.sources import prepare_source
    from tango_lm.eval.evaluate import evaluate_checkpoint

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i}: the quick brown fox {i * 7} jumps" for i in range(400)))
    # the command the README names for this dataset
    prepare_source("text", "data/mytext", inputs=[str(corpus)], split_on_blank_lines=True, tokenizer="byte")
    scope: dict = {}
    exec(compile(readme_python_blocks()[1], "README.md (Python: training)", "exec"), scope)
    summary, losses = scope["result"].summary, scope["result"].losses
    assert sorted(losses) == list(range(1, 21)) and math.isfinite(summary["test_nll"])
    assert (tmp_path / "runs" / "nb" / "summary.json").is_file()
    # the model loaded is the checkpoint the run selected: it scores the summary's test NLL
    assert evaluate_checkpoint("runs/nb", "test", device="cpu")["nll"] == pytest.approx(summary["test_nll"], abs=1e-6)
    assert not scope["model"].training
