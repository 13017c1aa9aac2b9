"""Edges of utils/paths.py (found by a mutation review): what a FIFO is, a file where a folder should be, names
that are not UTF-8, and the write probe for a long file name."""

import os

import pytest

from utils.chat.prompt_file import PromptFileError, read_prompt_file
from utils.paths import path_kind, printable_path, unwritable


def test_what_is_at_a_path(tmp_path):
    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    assert [path_kind(tmp_path / n) for n in ("f", "fifo", "none")] == ["file", "other", None]
    assert path_kind(tmp_path) == "dir" and path_kind(tmp_path / "f" / "below") is None  # a file as a folder: nothing


def test_a_file_where_a_folder_should_be_is_no_file_and_no_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PromptFileError, match=r"^no file at .*/f/q\.txt$"):
        read_prompt_file(str(tmp_path / "f" / "q.txt"))
    assert unwritable(str(tmp_path / "f" / "x.ngram")) == f"no folder {tmp_path / 'f'} to keep x.ngram in"


def test_a_name_that_is_not_utf8_prints_as_replacement_characters(tmp_path):
    name = os.fsdecode(b"caf\xe9.txt")  # a Latin-1 name, as Python gets it: a lone surrogate
    assert printable_path(tmp_path / name) == f"{tmp_path}/caf\ufffd.txt"
    printable_path(tmp_path / name).encode("utf-8")  # printable: no surrogate left


def test_a_long_file_name_in_a_writable_folder_is_writable(tmp_path):
    """The probe file is named after the target: a 250-character name (the system takes 255) must not make the
    probe's own name too long."""
    assert unwritable(str(tmp_path / ("n" * 245 + ".ngram"))) is None
    assert list(tmp_path.iterdir()) == []
