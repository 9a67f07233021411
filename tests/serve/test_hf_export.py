"""`tango-lm export CHECKPOINT --hf DIR` (serve/hf_export.py, serve/hf_modeling.py): the directory
loads offline with transformers' Auto classes, its logits are the model's log-probs, and greedy
`generate()` (cached or not) gives tango-lm's own greedy tokens.

Tests that load the directory are skipped when transformers is not installed
(`pip install 'tango-lm[eval]'`); writing it needs only tango-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tango_lm.cli import main
from tango_lm.data.bpe import train_bpe
from tango_lm.data.tokenizers import Tokenizer, get_tokenizer, tokenizer_from_dict
from tango_lm.layers.moe import capacity_factor
from tango_lm.serve.generate import generate
from tango_lm.train.checkpoint import load_checkpoint, save_checkpoint
from tango_lm.train.config import RunConfig
from tests import arch_cases, helpers

MODELING = helpers.ROOT / "src" / "tango_lm" / "serve" / "hf_modeling.py"
TEXTS = [
    "Hello world",
    "",
    "  tabs\tand\nnew lines\n\n",
    "never seen: zqxj ꙮ 🦜",
    "a <|endoftext|> b",
    "I'm you'll they've  double   spaces   ",
    "ÜNÏCÖDÉ 123456 3.14 ∑x²",
]
# Every registered architecture's tiny model (tests/arch_cases.py), and routed experts at a
# training capacity that drops tokens.
CASES = {**{arch: (arch, {}) for arch in arch_cases.names()}, "moe-dropping": ("moe", {"capacity_factor_train": 0.5})}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_checkpoint(root: Path, arch: str = "tango", tokenizer: str | Tokenizer = "byte", **model) -> Path:
    """A randomly initialized tiny checkpoint, its weights moved off their init so every path matters."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    cfg = arch_cases.tiny_fields(arch, **{"context_length": 48, "vocab_size": tok.vocab_size, **model})
    run = RunConfig.from_dict(
        {"model": cfg, "data": {"dir": str(root / "data")}, "train": {**helpers.TINY_TRAIN, "out_dir": str(root)}}
    )
    torch.manual_seed(0)
    net = run.model.build()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return save_checkpoint(root / "checkpoints", 7, net.state_dict(), {}, run.to_dict(), tok.to_dict(), {})


def export(ckpt: Path, out: Path) -> Path:
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("byte")
    ckpt = make_checkpoint(root)
    return ckpt, export(ckpt, root / "hf")


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def load_hf(transformers, path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True)
    return model.eval()


# -- the directory ----------------------------------------------------------------------------
def test_export_writes_a_self_describing_directory(byte_export):
    ckpt, out = byte_export
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling_tango_lm.py",
        "tango_tokenizer.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "tango_lm" and config["architectures"] == ["TangoLMForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "modeling_tango_lm.TangoLMConfig",
        "AutoModelForCausalLM": "modeling_tango_lm.TangoLMForCausalLM",
    }
    assert config["tango_config"] == load_checkpoint(ckpt).config["model"]
    assert config["eos_token_id"] == 256 and config["torch_dtype"] == "float32"
    assert (out / "modeling_tango_lm.py").read_text() == MODELING.read_text()
    weights = load_file(str(out / "model.safetensors"))
    source = load_file(str(ckpt / "model.safetensors"))
    assert weights.keys() == {f"model.{k}" for k in source}
    assert all(torch.equal(weights[f"model.{k}"], v) for k, v in source.items())
    assert tokenizer_from_dict(json.loads((out / "tango_tokenizer.json").read_text())).name == "byte"


def test_every_file_of_the_export_has_the_same_mode(byte_export):
    # safetensors writes 0600 whatever the umask: another user of a shared export could read
    # everything but the weights.
    _, out = byte_export
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_export_errors_are_one_line(tmp_path, capsys, byte_export):
    ckpt, _ = byte_export
    assert main(["export", str(tmp_path / "missing"), "--hf", str(tmp_path / "out")]) == 2
    assert "does not exist" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert main(["export", str(ckpt), "--hf", str(busy)]) == 2
    assert "--overwrite" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]

    (tmp_path / "file").write_text("x")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "file")]) == 2
    assert "not a directory" in helpers.assert_one_error_line(capsys.readouterr().err)

    # Into the checkpoint or its run (whose files an export's would replace), even with --overwrite;
    # or inside the checkpoint, which the old error advised and a resumed run's pruning removes.
    before = helpers.snapshot(ckpt.parent.parent)
    pruned = "is inside the run's checkpoints folder"
    for target, said in ((ckpt, pruned), (ckpt / "hf", pruned), (ckpt.parent / "hf", pruned)):
        assert main(["export", str(ckpt), "--hf", str(target), "--overwrite"]) == 2
        err = helpers.assert_one_error_line(capsys.readouterr().err)
        assert (
            said in err
            and f"which a resumed run prunes; export to a directory outside it (e.g. {ckpt.parent.parent / 'hf'})"
            in err
        )
    assert main(["export", str(ckpt), "--hf", str(ckpt.parent.parent), "--overwrite"]) == 2
    assert "is a tango-lm run directory" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert helpers.snapshot(ckpt.parent.parent) == before
    # A run that has not saved yet (interrupted before its first checkpoint, or live): its
    # config.json was replaced by the export's, and `train RUN --resume` no longer knew it.
    for i, present in enumerate((["config.json", "metrics.jsonl"], ["config.json"], ["metrics.jsonl"])):
        unsaved = tmp_path / f"unsaved-{i}"
        unsaved.mkdir()
        if "config.json" in present:
            shutil.copy(ckpt / "config.json", unsaved / "config.json")  # a run config
        if "metrics.jsonl" in present:
            (unsaved / "metrics.jsonl").write_text("")
        kept = helpers.snapshot(unsaved)
        assert main(["export", str(ckpt), "--hf", str(unsaved), "--overwrite"]) == 2
        assert "is a tango-lm run directory" in helpers.assert_one_error_line(capsys.readouterr().err)
        assert helpers.snapshot(unsaved) == kept
    (tmp_path / "to-checkpoints").symlink_to(ckpt.parent)  # through a link: where the files would go
    (tmp_path / "to-step").symlink_to(ckpt)
    for target in (tmp_path / "to-checkpoints" / "hf", tmp_path / "to-step"):
        assert main(["export", str(ckpt), "--hf", str(target), "--overwrite"]) == 2
        assert "; export to a directory outside it" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert helpers.snapshot(ckpt.parent.parent) == before
    lone = tmp_path / "lone-step"  # a checkpoint copied out of its run
    shutil.copytree(ckpt, lone)
    for target, said in ((lone, "is a tango-lm checkpoint directory"), (lone / "hf", "is inside the checkpoint")):
        assert main(["export", str(ckpt), "--hf", str(target), "--overwrite"]) == 2
        assert said in helpers.assert_one_error_line(capsys.readouterr().err)
    # A prepared dataset: its tokenizer.json was replaced by the export's, and read as another tokenizer.
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"format": "tango-lm-shards/1"}))  # what marks one
    (data / "tokenizer.json").write_text("{}")
    before = helpers.snapshot(data)
    for target in (data, data / "hf"):
        assert main(["export", str(ckpt), "--hf", str(target), "--overwrite"]) == 2
        assert "is inside the prepared dataset" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert helpers.snapshot(data) == before
    # A link to an empty folder (scratch storage): written through it ("Not a directory" before).
    (tmp_path / "scratch").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "scratch")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "scratch" / "model.safetensors").is_file()


def test_overwrite_replaces_the_export_and_keeps_other_files(tmp_path, capsys, byte_export):
    ckpt, first = byte_export
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "config.json").write_text("{}")
    assert main(["export", str(ckpt), "--hf", str(out), "--overwrite", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["hf_dir"] == str(out) and summary["step"] == 7 and "model.safetensors" in summary["files"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "config.json").read_text() == (first / "config.json").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    # A folder where a file goes: refused before any file moves (README.md, first in order, was replaced).
    blocked = tmp_path / "blocked"
    (blocked / "tokenizer.json").mkdir(parents=True)
    (blocked / "README.md").write_text("mine")
    before = helpers.snapshot(blocked)
    assert main(["export", str(ckpt), "--hf", str(blocked), "--overwrite"]) == 2
    assert "tokenizer.json is a directory" in helpers.assert_one_error_line(capsys.readouterr().err)
    assert helpers.snapshot(blocked) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- transformers --------------------------------------------------------------------------------
def test_auto_model_logits_are_the_models_log_probs(transformers, byte_export):
    ckpt, out = byte_export
    hf = load_hf(transformers, out)
    assert type(hf).__name__ == "TangoLMForCausalLM" and not hf.training
    ref = load_checkpoint(ckpt).build_model()
    ids = torch.randint(0, 257, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_hf = hf(ids)
        want = ref(ids)
        torch.testing.assert_close(out_hf.logits, want, rtol=0, atol=0)
        assert out_hf.logits.dtype == torch.float32
        # logits are normalized log-probs, so softmax gives the model's distribution back
        torch.testing.assert_close(out_hf.logits.softmax(-1).log(), want, rtol=1e-5, atol=1e-5)
        # labels: mean next-token NLL (shifted inside), -100 ignored
        loss = hf(ids, labels=ids).loss
        torch.testing.assert_close(loss, ref.nll(ids[:, :-1], ids[:, 1:]), rtol=1e-6, atol=1e-6)
        labels = ids.clone()
        labels[:, :10] = -100
        masked = -want[:, 9:-1].gather(-1, ids[:, 10:, None]).mean()
        torch.testing.assert_close(hf(ids, labels=labels).loss, masked, rtol=1e-6, atol=1e-6)


def check_round_trip(transformers, root: Path, arch: str, **model) -> None:
    """Export a checkpoint, load it with AutoModelForCausalLM: its logits are the model's
    log-probs, and greedy `generate()` with and without the cache gives `tango-lm generate`'s
    greedy tokens."""
    ckpt = make_checkpoint(root, arch, **model)
    hf = load_hf(transformers, export(ckpt, root / "hf"))
    ref = load_checkpoint(ckpt).build_model()
    prompts = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), capacity_factor(ref, "eval"):  # served as in external evaluation
        torch.testing.assert_close(hf(prompts).logits, ref(prompts), rtol=0, atol=0)
    for prompt in (prompts[:1], prompts):  # one prompt, and a batch of equal-length prompts
        want = generate(ref, prompt, 24, temperature=0)  # tango-lm generate --temperature 0 (--no-stop)
        kwargs = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": None}
        cached = hf.generate(prompt, **kwargs)
        assert cached.tolist() == want.tolist()
        assert hf.generate(prompt, use_cache=False, **kwargs).tolist() == want.tolist()
    # an end-of-text token ends generation in both (here: the first token greedy decoding picks)
    eos = int(want[0, 9])
    stopped = hf.generate(prompts[:1], max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert stopped.tolist() == generate(ref, prompts[:1], 24, temperature=0, eos_id=eos).tolist()
    assert stopped.shape[1] == 10
    # beam search reorders the cache rows
    beams = {"max_new_tokens": 8, "do_sample": False, "num_beams": 3, "eos_token_id": None}
    assert hf.generate(prompts[:1], **beams).tolist() == hf.generate(prompts[:1], use_cache=False, **beams).tolist()


def test_generate_never_picks_the_tables_padding_rows(transformers, tmp_path):
    # 320 rows for the byte tokenizer's 257 ids (as 50304 for GPT-2's 50257): the rows past it are
    # no tokens, and `tango-lm generate` never draws them; HF's generate() picked them.
    ckpt = make_checkpoint(tmp_path, "tango", vocab_size=320)
    hf = load_hf(transformers, export(ckpt, tmp_path / "hf"))
    assert hf.generation_config.suppress_tokens == list(range(257, 320))
    ref = load_checkpoint(ckpt).build_model()
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert ref(prompt)[0].argmax(-1).ge(257).any()  # padding rows are the argmax somewhere
    want = generate(ref, prompt, 24, temperature=0, vocab_size=257)
    got = hf.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert got.tolist() == want.tolist() and got.max() < 257


def test_generate_past_the_context_is_refused_before_it_starts(transformers, byte_export):
    # It failed only once the sequence reached the context, after generating up to it.
    hf = load_hf(transformers, byte_export[1])  # context 48
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    calls = []
    real = hf.forward
    hf.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    with pytest.raises(
        ValueError, match="generating to 109 tokens .* context of 48; give max_new_tokens of at most 40"
    ):
        hf.generate(prompt, max_new_tokens=100, do_sample=False, eos_token_id=None)
    assert calls == []
    for length in (49, 60):  # a prompt past the context: "at most 0", which transformers then refused
        with pytest.raises(ValueError, match=f"a prompt of {length} tokens is longer than the model's context of 48"):
            hf.generate(torch.zeros(1, length, dtype=torch.long), max_new_tokens=1, do_sample=False)
    # the last new token is never fed back: 49 tokens fit a context of 48, as in `tango-lm generate`
    got = hf.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = load_checkpoint(byte_export[0]).build_model()
    assert got.tolist() == generate(ref, prompt, 40, temperature=0, vocab_size=257).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generate_equals_tango_generate_with_and_without_cache(transformers, tmp_path, case):
    arch, changes = CASES[case]
    check_round_trip(transformers, tmp_path, arch, **changes)


def test_generate_on_static_steps_is_the_same(transformers, byte_export, monkeypatch):
    # What runs on CUDA (CUDA graphs there): static decode steps after the prompt, here run eagerly.
    import tango_lm.serve.static_decode as static_decode

    hf = load_hf(transformers, byte_export[1])
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    greedy = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None}
    beams = {"max_new_tokens": 6, "do_sample": False, "num_beams": 3, "eos_token_id": None}
    want = [hf.generate(prompt, **greedy).tolist(), hf.generate(prompt, **beams).tolist()]
    monkeypatch.setattr(static_decode, "default_mode", lambda device: "eager")
    assert [hf.generate(prompt, **greedy).tolist(), hf.generate(prompt, **beams).tolist()] == want
    assert hf.model._static_decoders  # the static decoder ran


def test_a_kept_cache_outlives_another_request_on_its_static_decoder(transformers, byte_export, monkeypatch):
    # The static decoder is kept on the model per batch size: a later generate() of that size
    # prefilled it over the tensors a kept cache read, and continuing the kept one went wrong.
    import tango_lm.serve.static_decode as static_decode

    hf = load_hf(transformers, byte_export[1])
    monkeypatch.setattr(static_decode, "default_mode", lambda device: "eager")  # CUDA's path, run eagerly
    prompt, other = (torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    greedy = {"do_sample": False, "eos_token_id": None}
    first = hf.generate(prompt, max_new_tokens=5, return_dict_in_generate=True, **greedy)
    assert not first.past_key_values.lost_static()
    # tango-lm's own generate on the same model and batch size prefills the same decoder
    generate(hf.model, other, 3, temperature=0, static="eager")
    assert first.past_key_values.lost_static()
    first = hf.generate(prompt, max_new_tokens=5, return_dict_in_generate=True, **greedy)
    hf.generate(other, max_new_tokens=3, **greedy)  # the same batch size: the same decoder
    cache = first.past_key_values
    assert cache.lost_static()
    with pytest.raises(ValueError, match="static decoder served another request since"):
        hf(first.sequences[:, -1:], past_key_values=cache)
    from tango_lm.serve.hf_modeling import CACHE_NAME

    went_on = hf.generate(first.sequences, max_new_tokens=6, **{CACHE_NAME: cache}, **greedy)
    assert went_on.tolist() == hf.generate(first.sequences, max_new_tokens=6, **greedy).tolist()


def test_forward_with_use_cache_returns_a_cache_to_continue_with(transformers, byte_export):
    # use_cache=True returned none, and passing that None on read the rest without its prefix.
    hf = load_hf(transformers, byte_export[1])
    ids = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = hf(ids).logits
        assert hf(ids).past_key_values is None  # a plain forward keeps no cache
        head = hf(ids[:, :10], use_cache=True)
        rest = hf(ids[:, 10:], past_key_values=head.past_key_values).logits
    torch.testing.assert_close(torch.cat([head.logits, rest], 1), full, rtol=1e-5, atol=1e-5)


def test_sampling_draws_from_the_whole_distribution(transformers, byte_export, monkeypatch):
    # transformers fills in top_k=50 where the generation config says nothing: do_sample=True drew
    # from the 50 likeliest tokens only, unlike `tango-lm generate`.
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:  # transformers warned of a top_k in the generation config (and 4.x refused to save it)
        hf = load_hf(transformers, byte_export[1])
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in records if "top_k" in r.getMessage()]
    assert hf.generation_config.top_k is None

    class Transformers4Config(type(hf.generation_config)):  # 4.x's default top_k is 50, not None
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.top_k = kwargs.get("top_k", 50)

    calls = []
    real = transformers.GenerationMixin.generate  # transformers' own, below the export's
    monkeypatch.setattr(
        transformers.GenerationMixin,
        "generate",
        lambda self, *a, **k: calls.append(k.get("top_k")) or real(self, *a, **k),
    )
    prompt1 = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    hf.generate(prompt1, generation_config=Transformers4Config(do_sample=True, max_new_tokens=1))
    hf.generate(prompt1, generation_config=Transformers4Config(do_sample=True, max_new_tokens=1, top_k=7))
    hf.generate(prompt1, max_new_tokens=1, do_sample=True, top_k=5)
    monkeypatch.undo()
    assert calls == [0, None, 5]  # a top_k the caller chose is kept
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3)).repeat(4000, 1)
    torch.manual_seed(0)
    drawn = hf.generate(prompt, max_new_tokens=1, do_sample=True, eos_token_id=None)[:, -1]
    with torch.no_grad():
        p = hf(prompt[:1]).logits[0, -1].exp()
    assert p.topk(50).values.sum() < 0.95  # a byte model's next byte: much of its mass past the top 50
    assert len(set(drawn.tolist())) > 50


def test_cached_forward_steps_reproduce_the_full_forward(transformers, byte_export):
    _, out = byte_export
    hf = load_hf(transformers, out)
    ids = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = hf(ids).logits
        cache = hf.new_cache()
        first = hf(ids[:, :12], cache=cache).logits
        steps = [hf(ids[:, i : i + 1], cache=cache).logits for i in range(12, 20)]
    assert cache.get_seq_length() == 20
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="padding"):
        hf(ids, attention_mask=torch.cat([torch.zeros(1, 1), torch.ones(1, 19)], 1).long())


def test_auto_tokenizer_matches_the_byte_tokenizer(transformers, byte_export):
    _, out = byte_export
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    ours = get_tokenizer("byte")
    assert tok.eos_token_id == ours.eot_id == 256 and len(tok) == 257
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ours.encode(text), text  # nothing added around the ids; <|endoftext|> stays text
        assert tok.decode(ids) == text


def test_auto_tokenizer_matches_gpt2(transformers, tmp_path):
    out = export(
        make_checkpoint(tmp_path, tokenizer="gpt2", d_model=16, head_dim=8, width=16, depth=1), tmp_path / "hf"
    )
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    ours = get_tokenizer("gpt2")
    assert tok.eos_token_id == ours.eot_id == 50256 and len(tok) == 50257
    for text in [*TEXTS, "def square(x):\n    return x * x", "trailing \n\n  "]:
        ids = tok(text).input_ids
        assert ids == ours.encode(text), text
        assert tok.decode(ids) == text


def test_auto_tokenizer_matches_a_trained_bpe(transformers, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(
        "The quick brown fox jumps over the lazy dog. " * 20 + "def f(x):\n    return x\n" * 10
    )
    ours = train_bpe([corpus], 300, tmp_path / "tokenizer.json", progress=False)
    out = export(make_checkpoint(tmp_path, tokenizer=ours, d_model=16, head_dim=8, width=16, depth=1), tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    assert tok.eos_token_id == ours.eot_id and len(tok) == ours.vocab_size
    for text in [*TEXTS, "The lazy fox. def g(y):\n    return y"]:
        ids = tok(text).input_ids
        assert ids == ours.encode(text), text
        assert tok.decode(ids) == ours.decode(ids)


def test_auto_tokenizer_of_a_bpe_with_a_post_processor_adds_nothing(transformers, tmp_path):
    # A hub tokenizer.json may wrap every text in special tokens (a post-processor); tango-lm
    # encodes without them, so the export's tokenizer must too, or generate() sees other prompts.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    trained = train_bpe([corpus], 300, tmp_path / "trained.json", progress=False)
    hf = HFTokenizer.from_str(trained.to_json())
    eot = ("<|endoftext|>", trained.eot_id)
    hf.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A <|endoftext|>", special_tokens=[eot])
    hf.save(str(tmp_path / "hub.json"))
    ours = get_tokenizer(f"bpe:{tmp_path / 'hub.json'}")
    out = export(make_checkpoint(tmp_path, tokenizer=ours, d_model=16, head_dim=8, width=16, depth=1), tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True, local_files_only=True)
    for text in ["The lazy fox.", "a <|endoftext|> b"]:
        assert tok(text).input_ids == ours.encode(text), text


def fresh_process(transformers, script: str, export_dir: Path, tmp_path: Path) -> str:
    """Run `script` (argv[1]: the export) in a new Python with stdin closed; its stdout and stderr
    together. A trust-remote-code prompt shows up as its text (input() then reads EOF), a config
    read by the wrong class as transformers' "model of type" warning."""
    import os
    import subprocess
    import sys

    src = str(helpers.ROOT / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "TRANSFORMERS_VERBOSITY": "info",
    }
    proc = subprocess.run(
        [sys.executable, "-u", "-c", script, str(export_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def asked(text: str) -> bool:
    return "custom code" in text or "[y/N]" in text


LOAD_BOTH = """
import sys
import transformers
path = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True)
tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)  # no trust_remote_code
print("loaded", type(model).__name__, type(model.config).__name__, tokenizer("ab").input_ids)
"""


def test_auto_classes_load_without_a_prompt_or_a_model_type_warning(transformers, byte_export, tmp_path):
    """The model first, then AutoTokenizer without trust_remote_code: neither asks nor warns."""
    text = fresh_process(transformers, LOAD_BOTH, byte_export[1], tmp_path)
    assert "loaded TangoLMForCausalLM TangoLMConfig [97, 98]" in text
    assert not asked(text) and "model of type" not in text


# Tokenizer first, in one process: each step's output follows its "@@ STEP" line.
TOKENIZER_FIRST = """
import sys
import transformers
path = sys.argv[1]
def step(name, load):
    print(f"@@ {name}", flush=True)
    loaded = load()
    if isinstance(loaded, transformers.PreTrainedModel):
        print("loaded", type(loaded).__name__, type(loaded.config).__name__, flush=True)
    else:
        print("ids", loaded("a <|endoftext|> b").input_ids, loaded.eos_token_id, flush=True)
step("auto", lambda: transformers.AutoTokenizer.from_pretrained(path, local_files_only=True))
step("fast", lambda: transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True))
step("trusted", lambda: transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True, local_files_only=True))
step("model", lambda: transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                                        local_files_only=True))
"""


def test_tokenizer_first_in_a_fresh_process(transformers, byte_export, tmp_path):
    """AutoTokenizer before anything registered the `tango_lm` type. transformers 5 builds the model
    config first (tokenization_auto: AutoConfig.from_pretrained(trust_remote_code=None) before
    tokenizer_config.json), and for a type it does not know, config.json's auto_map.AutoConfig
    (which AutoModelForCausalLM needs) makes it ask (dynamic_module_utils.resolve_trust_remote_code),
    then fall back to a bare config with the "model of type" warning. The export cannot avoid that
    (serve/hf_export.py says why); this pins it, so the README changes when transformers does. The
    ways the README gives instead ask nothing and warn nothing, and every tokenizer gives our ids."""
    text = fresh_process(transformers, TOKENIZER_FIRST, byte_export[1], tmp_path)
    sections = dict(part.split("\n", 1) for part in text.split("@@ ")[1:])
    assert list(sections) == ["auto", "fast", "trusted", "model"], text
    ours = get_tokenizer("byte")
    for step in ("auto", "fast", "trusted"):
        assert f"ids {ours.encode('a <|endoftext|> b')} {ours.eot_id}" in sections[step], sections[step]
    assert "loaded TangoLMForCausalLM TangoLMConfig" in sections["model"]
    for step in ("fast", "trusted", "model"):
        assert not asked(sections[step]) and "model of type" not in sections[step], sections[step]
    transformers_5 = int(transformers.__version__.split(".")[0]) >= 5
    assert asked(sections["auto"]) == ("model of type" in sections["auto"]) == transformers_5, (
        "AutoTokenizer no longer behaves as the README says: update it and serve/hf_export.py\n" + sections["auto"]
    )


def test_importing_the_modeling_module_registers_the_model_type(transformers, byte_export, caplog):
    """After `import tango_lm.serve.hf_modeling` neither Auto class needs trust_remote_code. (pytest's
    stdin raises when read, so a prompt would fail over to the warning checked here.)"""
    import logging

    import tango_lm.serve.hf_modeling as hf_modeling

    _, out = byte_export
    transformers.logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert isinstance(model, hf_modeling.TangoLMForCausalLM) and tokenizer("ab").input_ids == [97, 98]
    assert "model of type" not in caplog.text and "custom code" not in caplog.text
