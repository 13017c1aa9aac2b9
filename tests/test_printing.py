"""Edges of utils/printing.py (found by a mutation review): one-line errors, colour switches, notes said once,
debug rounds without a tokenizer and after a long answer."""

import io

from test_chat_session import byte_tokenizer  # one token per byte
from utils import printing
from utils.printing import RoundTexts, format_round, one_line, paint


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_line_keeps_300_characters_and_names_an_empty_error():
    assert one_line(ValueError("a\n  b\tc")) == "a b c"
    assert one_line(ValueError("x" * 300)) == "x" * 300
    assert one_line(ValueError("x" * 301)) == "x" * 300 + "…"
    assert one_line(KeyError()) == "KeyError" and one_line(OSError(" \n ")) == "OSError"


def test_no_color_wins_over_force_color_and_a_closed_stream_is_no_terminal(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    assert paint("x", "red", Terminal()) == "x"
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.delenv("FORCE_COLOR")
    assert not printing.on_terminal(None) and not printing.takes_escapes(io.StringIO())
    assert printing.takes_escapes(Terminal())


def test_a_note_is_said_once(monkeypatch, capsys):
    monkeypatch.setattr(printing, "_notes_said", set())
    printing.note_once("two models, one note")
    printing.note_once("two models, one note")
    printing.note_once("another")
    assert capsys.readouterr().err == "two models, one note\nanother\n"


def test_debug_rounds_without_a_tokenizer_are_ids_apart(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    texts = RoundTexts(None)
    assert format_round(texts, [5, 6, 7], 1, [5, 9], io.StringIO()) == "[+[5]+] [-[6]-] [-[7]-] [9]"
    assert texts.held() == ""


def test_a_character_split_after_a_long_answer_still_shows_whole(monkeypatch):
    """The context the rounds decode after is the answer's last tokens, not its first."""
    monkeypatch.setenv("NO_COLOR", "1")
    tokenizer = byte_tokenizer()
    ids = tokenizer("abcdefghijkl🍞")["input_ids"]
    assert len(ids) == 16  # 🍞: the last four
    texts = RoundTexts(tokenizer)
    shown = format_round(texts, ids[:11], 11, ids[:12], io.StringIO())
    assert shown == "".join(f"[+{c}+]" for c in "abcdefghijk") + "l"
    assert format_round(texts, ids[12:14], 2, ids[12:15], io.StringIO()) == "[++][++]"  # 🍞's first three bytes
    assert texts.held() == "\ufffd"  # an answer ending here ends inside 🍞
    assert format_round(texts, [], 0, ids[15:16], io.StringIO()) == "🍞"
    assert texts.held() == ""
