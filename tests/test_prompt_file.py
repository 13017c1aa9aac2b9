"""`--prompt-file` and `/file`: a text file as the prompt, anything wrong with it one line (PromptFileError)."""

import re
from pathlib import Path

import pytest

from utils.chat.prompt_file import MAX_PROMPT_FILE_BYTES, PromptFileError, read_prompt_file, typed_path
from utils.printing import one_line


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


# Found by a mutation review: the size limit's boundary, which reading of a typed /file path wins, what is stripped;
# and two bugs (a long path hid the reason of the error after it; a NUL in a path was a bare ValueError).
def test_a_file_of_exactly_the_limit_is_read(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * MAX_PROMPT_FILE_BYTES)
    assert len(read_prompt_file(str(path))) == MAX_PROMPT_FILE_BYTES
    path.write_bytes(b"x" * MAX_PROMPT_FILE_BYTES + b"\n")  # a byte more, even white space: refused
    with pytest.raises(PromptFileError, match="is over 1 MB"):
        read_prompt_file(str(path))


def test_several_shell_words_are_not_a_path_even_where_the_first_is_a_file(tmp_path):
    """`/file notes.txt please summarise` names no file: it is not read as `notes.txt`."""
    (tmp_path / "notes.txt").write_text("n")
    typed = f"{tmp_path / 'notes.txt'} please"
    assert typed_path(typed) == typed
    with pytest.raises(PromptFileError, match="no file at .*notes.txt please$"):
        read_prompt_file(typed_path(typed))


def test_a_name_as_typed_wins_over_its_shell_reading(tmp_path, monkeypatch):
    """A file whose name holds quotes is that file, although the unquoted name is another file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "'q.txt'").write_text("quoted name")
    (tmp_path / "q.txt").write_text("plain name")
    assert typed_path("'q.txt'") == "'q.txt'" and read_prompt_file(typed_path("'q.txt'")) == "quoted name"
    assert typed_path("'p q.txt'") == "'p q.txt'"  # neither reading names a file: as typed


def test_a_path_of_spaces_or_a_blank_name_is_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert typed_path("   ") == "   "
    (tmp_path / "   ").mkdir()  # a folder named by spaces is there, yet a blank /file names nothing
    assert typed_path("'   '") == "'   '"
    with pytest.raises(PromptFileError, match="give a file's path"):
        read_prompt_file("   ")


def test_utf16_text_of_nuls_is_refused_and_text_inside_is_stripped(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa\x00b".encode("utf-16-le"))  # valid UTF-16 holding a NUL: not text
    with pytest.raises(PromptFileError, match="is UTF-32 or binary"):
        read_prompt_file(str(path))
    path.write_bytes(b"\xef\xbb\xbf  \n hello \n\n")  # a UTF-8 BOM, then white space around the text
    assert read_prompt_file(str(path)) == "hello"


@pytest.mark.parametrize("content, reason", [(b"", "is empty"), (b"a\x00b", "is binary"),
                                             (b"caf\xe9", "is not valid UTF-8"),
                                             ("\ufeffa\x00".encode("utf-16-le"), "is UTF-32 or binary")])
def test_the_reason_is_not_cut_off_after_a_long_path(tmp_path, content, reason):
    """The chat shows `one_line` of the error (300 characters): a path of 400 showed none of the reason."""
    deep = tmp_path.joinpath(*["d" * 120] * 3)
    deep.mkdir(parents=True)
    (deep / "p.txt").write_bytes(content)
    with pytest.raises(PromptFileError) as error:
        read_prompt_file(str(deep / "p.txt"))
    assert reason in one_line(ValueError(f"/file: {error.value}"))


def test_a_nul_in_a_path_is_one_line(tmp_path):
    for spec in ("a\x00b.txt", f"{tmp_path}/x\x00.txt"):
        with pytest.raises(PromptFileError, match="^no file at .*: a path cannot hold a NUL character$"):
            read_prompt_file(spec)
