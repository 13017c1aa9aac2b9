"""`--prompt-file` and `/file`: a text file as the prompt, anything wrong with it one line (PromptFileError)."""

import re
from pathlib import Path

import pytest

from utils.chat.prompt_file import MAX_PROMPT_FILE_BYTES, PromptFileError, read_prompt_file


def test_a_text_file_is_its_stripped_text(tmp_path):
    (tmp_path / "a b.py").write_text("\n  def f():\n    return 1  \n\n", encoding="utf-8")
    assert read_prompt_file(f" {tmp_path / 'a b.py'} ") == "def f():\n    return 1"


@pytest.mark.parametrize("content, message", [
    (None, "no file at"),
    ("folder", "is a folder"),
    (b"PK\x03\x04\x00\x00binary", "is binary"),
    ("hello".encode("utf-16-le"), "or UTF-16 without a byte-order mark; save it as UTF-8"),
    ("hello".encode("utf-32"), "is UTF-32 or binary"),  # its mark begins as UTF-16's: was text full of NULs
    ("caf\u00e9".encode("latin-1"), "is not valid UTF-8 (byte 3)"),
    (b" \n\t\n", "is empty"),
    (b"x" * (MAX_PROMPT_FILE_BYTES + 1), "is over 1 MB"),
])
def test_what_is_wrong_is_one_line(tmp_path, content, message):
    path = tmp_path / "prompt.txt"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(PromptFileError, match=re.escape(message)) as error:
        read_prompt_file(str(path))
    assert "\n" not in str(error.value)


def test_an_empty_path_and_an_unreadable_file(tmp_path, monkeypatch):
    with pytest.raises(PromptFileError, match="give a file's path"):
        read_prompt_file("  ")
    path = tmp_path / "secret.txt"
    path.write_text("hello")

    def refuse(*args, **kwargs):  # what open() raises without read permission (root would read it anyway)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(PromptFileError, match="cannot read .*secret.txt: Permission denied"):
        read_prompt_file(str(path))


def test_a_home_of_no_user_is_one_line():
    """`~nosuchuser/x.txt`: pathlib's RuntimeError was a traceback."""
    with pytest.raises(PromptFileError, match="^no file at ~nosuchuser-specdec/q.txt: ~nosuchuser-specdec names no user"):
        read_prompt_file("~nosuchuser-specdec/q.txt")


def test_a_name_longer_than_the_system_takes_is_one_short_line(tmp_path):
    """`Path.exists` raises for it: `--prompt-file` showed a traceback, `/file` a generic OSError line."""
    with pytest.raises(PromptFileError, match=r"^cannot read .*\(5\d\d\d characters\): File name too long$") as error:
        read_prompt_file(str(tmp_path / ("x" * 5000)))
    assert len(str(error.value)) < 250


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le-bom", "utf-16-be-bom"])
def test_a_byte_order_mark_is_no_part_of_the_prompt_and_utf16_is_read(tmp_path, encoding):
    """A UTF-8 BOM reached the target as a token; a UTF-16 file was called binary."""
    import codecs

    text = "def café():\n    return '🙂'"
    data = {"utf-8-sig": codecs.BOM_UTF8 + text.encode(), "utf-16": text.encode("utf-16"),
            "utf-16-le-bom": codecs.BOM_UTF16_LE + text.encode("utf-16-le"),
            "utf-16-be-bom": codecs.BOM_UTF16_BE + text.encode("utf-16-be")}[encoding]
    (tmp_path / "p.py").write_bytes(data)
    assert read_prompt_file(str(tmp_path / "p.py")) == text


def test_file_takes_a_path_as_typed_quoted_or_escaped(tmp_path):
    """A sweep: `/file` rebuilt its path from words, so runs of spaces became one, and quotes or backslashes (a
    terminal's paste of a dragged file) were read as part of the name: files that were there, "no file at"."""
    from utils.chat.commands import parse_command
    from utils.chat.prompt_file import typed_path

    folder = tmp_path / "dir with  two spaces"
    folder.mkdir()
    (folder / "my file.py").write_text("x = 1")
    (tmp_path / "trail.py ").write_text("y = 2")
    (tmp_path / "it's.py").write_text("z = 3")
    plain = f"{folder}/my file.py"
    command, values = parse_command(f"/file   {plain}")
    assert command.name == "file" and values == [plain]  # runs of spaces kept, those before the path not
    escaped = plain.replace(" ", "\\ ")
    for typed in (plain, f"'{plain}'", f'"{plain}"', escaped):
        assert read_prompt_file(typed_path(typed)) == "x = 1", typed
    assert read_prompt_file(typed_path(f"'{tmp_path}/trail.py '")) == "y = 2"  # quoted: its trailing space kept
    assert read_prompt_file(typed_path(f"{tmp_path}/it's.py")) == "z = 3"  # an unbalanced quote in a real name
    with pytest.raises(PromptFileError, match=r"no file at .*/dir with  two spaces/none\.py$"):
        read_prompt_file(typed_path(f"{folder}/none.py"))  # said as typed
