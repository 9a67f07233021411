"""Tokenizers: round trips, known GPT-2 ids, descriptions and the registry."""

from __future__ import annotations

import json

import pytest

from tango_lm.data.tokenizers import (
    ByteTokenizer,
    GPT2Tokenizer,
    get_tokenizer,
    same_tokenizer,
    tokenizer_from_dict,
)
from tango_lm.errors import UserError

TEXTS = [
    "Hello world",
    "",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Unicode: héllo wörld, 日本語, emoji 😀, math ∑ x² ≤ π",
    "Code: def f(x):\n    return x ** 2  # comment",
    "What is 12 + 5?\n17",
    "text with <|endoftext|> inside",
]


@pytest.fixture(scope="module")
def gpt2() -> GPT2Tokenizer:
    return GPT2Tokenizer()


def test_byte_tokenizer_basics():
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 257, 256)
    assert tok.encode("hé") == [104, 195, 169]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_byte_decode_drops_eot_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 256]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"
    # A multi-byte character cut in half must not raise.
    assert tok.decode(tok.encode("😀")[:2]) == "\ufffd"


def test_gpt2_known_ids(gpt2):
    assert (gpt2.name, gpt2.vocab_size, gpt2.eot_id) == ("gpt2", 50257, 50256)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262]
    assert gpt2.encode("hello") == [31373]
    assert gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.decode([15496, 50300, 11, -1]) == "Hello,"  # past the vocabulary (a padded table's rows): no text


def test_gpt2_round_trip_and_batch(gpt2):
    for text in TEXTS:
        assert gpt2.decode(gpt2.encode(text)) == text
    assert gpt2.encode_batch(TEXTS) == [gpt2.encode(t) for t in TEXTS]


def test_gpt2_never_emits_eot_from_text(gpt2):
    ids = gpt2.encode("a <|endoftext|> b")
    assert gpt2.eot_id not in ids
    assert gpt2.decode(ids) == "a <|endoftext|> b"


def test_to_dict_is_json_and_rebuilds(gpt2):
    for tok in (ByteTokenizer(), gpt2):
        d = json.loads(json.dumps(tok.to_dict()))
        assert len(d["fingerprint"]) == 64
        again = tokenizer_from_dict(d)
        assert type(again) is type(tok)
        assert same_tokenizer(d, again.to_dict())
        assert again.encode("Hello world") == tok.encode("Hello world")


def test_same_tokenizer_tells_them_apart(gpt2):
    b, g = ByteTokenizer().to_dict(), gpt2.to_dict()
    assert not same_tokenizer(b, g)
    assert not same_tokenizer(g, {**g, "fingerprint": "0" * 64})
    assert same_tokenizer(g, dict(g))


def test_get_tokenizer_unknown_lists_names():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(UserError, match="unknown tokenizer 'nope'.*byte, gpt2"):
        get_tokenizer("nope")


def test_from_dict_rejects_unknown_and_changed(gpt2):
    with pytest.raises(UserError, match="unknown tokenizer"):
        tokenizer_from_dict({"name": "sentencepiece"})
    with pytest.raises(UserError, match="fingerprint"):
        tokenizer_from_dict({**gpt2.to_dict(), "fingerprint": "f" * 64})


def test_gpt2_builds_offline(monkeypatch):
    import socket

    from tango_lm.data import tokenizers

    def no_network(*args, **kwargs):
        raise AssertionError("the GPT-2 tokenizer must not open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    tokenizers._gpt2_encoding.cache_clear()
    assert GPT2Tokenizer().encode("Hello world") == [15496, 995]
