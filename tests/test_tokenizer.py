"""load_tokenizer: tokenizer.json through `tokenizers`, the byte-level fallback otherwise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import tokenizer as tokenizer_module
from agent.tokenizer import (END_OF_TEXT, ByteTokenizer, HFTokenizer, TokenizerError, byte_level_tokenizer_json,
                             load_tokenizer)

texts = st.text(max_size=200).filter(lambda s: END_OF_TEXT not in s)


@pytest.fixture(scope="module")
def byte_json_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    (path / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return path


def test_fallback_ids_are_the_utf8_bytes(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("aé€") == [0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]


@given(texts)
def test_fallback_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_fallback_decode_drops_special_ids_and_marks_broken_utf8():
    tok = ByteTokenizer()
    assert tok.decode([104, 256, 105, 50000]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"  # half of "é"


def test_fallback_refuses_a_vocab_smaller_than_the_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    with pytest.raises(TokenizerError, match="vocab_size=128.*tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_is_used_when_present(byte_json_dir):
    tok = load_tokenizer(byte_json_dir)
    assert isinstance(tok, HFTokenizer)
    # the special token is one id in tokenizers' hands, 13 bytes in the fallback's
    assert tok.encode(f"a{END_OF_TEXT}") == [97, 256]
    assert tok.decode([97, 256, 98]) == "ab"


@settings(max_examples=200)
@given(texts)
def test_byte_level_tokenizer_json_agrees_with_the_fallback(byte_json_dir, text):
    tok = load_tokenizer(byte_json_dir)
    assert tok.encode(text) == ByteTokenizer().encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_a_word_level_tokenizer_json_is_honoured(tmp_path):
    """Not just our byte tokenizer: a different tokenizer.json gives its own ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world moon") == [1, 2, 0]
    assert loaded.decode([2, 1]) == "world hello"


def test_malformed_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_checks_text_only_where_its_encoding_fails(byte_json_dir, monkeypatch):
    """An agent's request has checked its prompt already (agent/serve/requests.py): encoding valid text checks
    it no second time; a lone surrogate is still named by where it is (the test below)."""
    monkeypatch.setattr(tokenizer_module, "check_text", lambda text: pytest.fail(f"{text!r} checked again"))
    for tokenizer in (ByteTokenizer(), HFTokenizer(byte_json_dir / "tokenizer.json")):
        assert tokenizer.encode("aé€") == [0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]


@pytest.mark.parametrize("text, at", [("\ud800", 0), ("caf\udce9 au lait", 3)])
def test_both_tokenizers_refuse_a_lone_surrogate_by_where_it_is(byte_json_dir, text, at):
    """The command line keeps bytes that are not UTF-8 as lone surrogates: encoding them was a TypeError
    (tokenizers) or a UnicodeEncodeError traceback (the fallback) in generate and warmup."""
    for tokenizer in (ByteTokenizer(), HFTokenizer(byte_json_dir / "tokenizer.json")):
        with pytest.raises(ValueError, match=f"lone surrogate .* at character {at} "):
            tokenizer.encode(text)
