"""What an export's defaults make transformers do (serve/hf_export.py, serve/hf_modeling.py):
plain `generate()` is greedy and ends at end-of-text, and the tokenizer's model_max_length is the
window the run trained.

Destination: tests/serve/test_hf_export_defaults.py (reuses make_checkpoint, export and load_hf
from tests/serve/test_hf_export.py). Skipped without transformers for the loading tests."""

from __future__ import annotations

import json

import pytest
import torch

from tango_lm.serve.generate import generate
from tango_lm.train.checkpoint import load_checkpoint
from tests.serve.test_hf_export import export, load_hf, make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    ckpt = make_checkpoint(root)
    return ckpt, export(ckpt, root / "hf")


def test_plain_generate_is_greedy_and_ends_at_end_of_text(transformers, exported):
    ckpt, out = exported
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["do_sample"] is False and gen["eos_token_id"] == gen["pad_token_id"] == 256
    hf = load_hf(transformers, out)
    assert hf.generation_config.eos_token_id == 256 and hf.config.eos_token_id == 256
    ref = load_checkpoint(ckpt).build_model()
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    want = generate(ref, prompt, 12, temperature=0, eos_id=256)
    for seed in (0, 1):  # no do_sample given: greedy, whatever the global RNG
        torch.manual_seed(seed)
        assert hf.generate(prompt, max_new_tokens=12).tolist() == want.tolist()


def test_tokenizer_model_max_length_is_the_trained_window(transformers, tmp_path):
    ckpt = make_checkpoint(tmp_path)  # context 48
    config = json.loads((ckpt / "config.json").read_text())
    assert config["train"].get("seq_len") in (None, 48)
    seq = tmp_path / "seq"
    seq.mkdir()
    ckpt2 = make_checkpoint(seq)
    cfg2 = json.loads((ckpt2 / "config.json").read_text())
    cfg2["train"]["seq_len"] = 24
    (ckpt2 / "config.json").write_text(json.dumps(cfg2))
    meta = json.loads((ckpt2 / "meta.json").read_text())
    meta["sha256"].pop("config.json", None)
    (ckpt2 / "meta.json").write_text(json.dumps(meta))
    for path, window in ((ckpt, 48), (ckpt2, 24)):
        out = export(path, path.parent.parent / "hf")
        assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == window
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
        assert tok.model_max_length == window
        assert len(tok("x" * 100, truncation=True).input_ids) == window
