"""CompletionText: a completion's text cut before its first stop string, what of it may be sent when,
and its tokens decoded incrementally (as on the whole text, at a cost that does not grow with it)."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.serve.stops import CompletionText
from agent.tokenizer import ByteTokenizer, HFTokenizer, byte_level_tokenizer_json

BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> HFTokenizer:
    """The demo model's tokenizer.json: `tokenizers`' ByteLevel decoder, one token per byte."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(byte_level_tokenizer_json())
    return HFTokenizer(path)


def feed(text: CompletionText, data: Sequence[int]) -> list[str]:
    return [text.add(b) for b in data]


def test_text_ends_before_the_first_stop_string_to_be_generated():
    text = CompletionText(BYTES.decode, ["lo w", "o"])
    assert feed(text, b"hello world") == ["h", "e", "", "l", "l"] + [""] * 6  # an "l" may begin "lo w"; "o" ends first
    assert text.stopped and text.finish() == ""


def test_a_tail_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    text = CompletionText(BYTES.decode, ["END"])
    assert feed(text, b"abEN") == ["a", "b", "", ""]
    assert text.add(ord("x")) == "ENx" and not text.stopped and text.finish() == ""


def test_a_tail_held_back_is_sent_when_the_completion_ends_without_the_stop():
    text = CompletionText(BYTES.decode, ["END"])
    assert feed(text, b"abEN") == ["a", "b", "", ""] and text.finish() == "EN"


def test_an_incomplete_character_is_held_back_and_sent_once_whole():
    text = CompletionText(BYTES.decode)
    assert feed(text, "a€".encode()) == ["a", "", "", "€"]
    assert text.add(0xE2) == "" and text.finish() == "\ufffd"  # a byte never completed is sent as U+FFFD at the end


def test_a_stop_string_made_whole_by_a_multibyte_character_split_across_tokens_is_found():
    text = CompletionText(BYTES.decode, ["x€"])
    assert "".join(feed(text, "ax€b".encode())) == "a" and text.stopped


def test_a_stop_string_across_tokens_of_several_characters(byte_level):
    """Tokens of the byte-level tokenizer.json; the stop string's characters arrive in three tokens."""
    text = CompletionText(byte_level.decode, ["é!"])
    assert "".join(feed(text, "caf".encode() + "é!".encode() + b"more")) == "caf" and text.stopped


def test_a_sentencepiece_token_decodes_with_its_leading_space_after_the_first(tmp_path):
    """Metaspace decoders drop a token's leading space at the start of a text only: decoded alone, the
    second word would lose its space."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {"\u2581hello": 0, "\u2581world": 1, "!": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    decode = HFTokenizer(tmp_path / "tokenizer.json").decode
    text = CompletionText(decode)
    assert "".join(feed(text, [0, 1, 2, 1])) + text.finish() == decode([0, 1, 2, 1]) == "hello world! world"


def test_each_token_decodes_a_few_tokens_however_long_the_completion():
    """Decoding the whole text at every token was quadratic in the completion's length."""
    longest = 0

    def decode(ids: Sequence[int]) -> str:
        nonlocal longest
        longest = max(longest, len(ids))
        return BYTES.decode(ids)

    data = ("a €😀 \xff" * 400).encode() + bytes([0x80, 0xE2, 0xF0] * 100)  # ends in 300 bytes of garbage
    text = CompletionText(decode, ["zz"])
    assert "".join(feed(text, data)) + text.finish() == BYTES.decode(data)
    assert longest <= 16


def reference(decode, ids: Sequence[int], stops: Sequence[str]) -> str:
    """The old way: the whole text decoded at every token, cut where the first stop string to complete starts."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        found = [i for s in stops if (i := text.find(s)) >= 0]
        if found:
            return text[:min(found)]
    return decode(ids)


# bytes that make and break characters: ASCII, continuation bytes, 2/3/4-byte leads, and some whole characters
TOKENS = st.lists(st.sampled_from([0x61, 0x62, 0x80, 0xA2, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98]) |
                  st.integers(0, 255), max_size=60)
STOPS = st.lists(st.text(alphabet="ab\u00e9\u20ac\ufffd", min_size=1, max_size=3), max_size=3)


@given(TOKENS, STOPS)
def test_the_pieces_are_the_whole_text_decoded_at_once_and_cut_at_the_first_stop(ids, stops):
    text = CompletionText(BYTES.decode, stops)
    assert "".join(feed(text, ids)) + text.finish() == reference(BYTES.decode, ids, stops)


@given(TOKENS, STOPS)
def test_the_tokenizer_json_path_agrees_with_decoding_the_whole_text(byte_level, ids, stops):
    text = CompletionText(byte_level.decode, stops)
    assert "".join(feed(text, ids)) + text.finish() == reference(byte_level.decode, ids, stops)
