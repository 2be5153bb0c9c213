"""CompletionText: a completion's text cut before its first stop string, and what of it may be sent."""
from __future__ import annotations

from agent.serve.stops import CompletionText
from agent.tokenizer import ByteTokenizer


def feed(text: CompletionText, data: bytes) -> list[int]:
    return [text.add(b) for b in data]


def test_text_ends_before_the_first_stop_string_to_be_generated():
    text = CompletionText(ByteTokenizer().decode, ["lo w", "o"])
    assert feed(text, b"hello world") == [1, 2, 2, 3, 4] + [4] * 6  # an "l" may begin "lo w"; "o" completes first
    assert text.cut == 4 and text.text[:text.end()] == "hell"


def test_a_tail_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    text = CompletionText(ByteTokenizer().decode, ["END"])
    assert feed(text, b"abEN") == [1, 2, 2, 2]
    assert text.add(ord("x")) == 5 and text.cut is None and text.end() == 5


def test_an_incomplete_character_is_held_back_and_the_rest_sent_at_the_end():
    text = CompletionText(ByteTokenizer().decode)
    assert feed(text, "a€".encode()) == [1, 1, 1, 2]
    assert text.add(0xE2) == 2 and text.end() == 3  # a byte never completed is sent as U+FFFD when the text ends


def test_a_stop_string_made_whole_by_a_multibyte_character_is_found():
    text = CompletionText(ByteTokenizer().decode, ["x€"])
    feed(text, "ax€b".encode())
    assert text.cut == 1 and text.text[:text.end()] == "a"
