"""A text file as the prompt (`--prompt-file FILE`, `/file PATH`): a whole source file with a question about it.

Everything that can be wrong with the file is one line, before any model runs: missing, a folder, unreadable,
binary, not UTF-8, empty, or larger than any context the embedded models have.
"""

from __future__ import annotations

import codecs
import shlex

from utils.paths import expand_user, path_kind, short_path

# 1 MB of text is ~250k tokens, several times the longest context of the models we ship (32k): a larger file is
# no prompt, and reading it whole (then tokenizing it) would only make the user wait for that answer.
MAX_PROMPT_FILE_BYTES = 1_000_000


class PromptFileError(ValueError):
    """What is wrong with a prompt file, in one line."""


def typed_path(typed: str) -> str:
    """The path `/file` was given: as typed (runs of spaces kept) where a file or folder is there, else as a shell
    reads it where that names one (quoted, or with backslash escapes: what a terminal pastes for a dragged file),
    else as typed, for `read_prompt_file` to say what is wrong."""
    try:
        words = shlex.split(typed)
    except ValueError:  # an unbalanced quote: a name may hold one
        words = []
    for candidate in [typed] + (words if len(words) == 1 else []):
        if names_a_path(candidate):
            return candidate
    return typed


def names_a_path(text: str) -> bool:
    """Whether something (a file, a folder, a FIFO) is at `text`; errors are for `read_prompt_file` to name."""
    try:
        return bool(text.strip()) and path_kind(expand_user(text)) is not None
    except (OSError, ValueError):  # too long a name, an unknown ~user: said by `read_prompt_file`
        return False


def read_prompt_file(spec: str) -> str:
    if not spec.strip():
        raise PromptFileError("give a file's path")
    name = spec if names_a_path(spec) else spec.strip()  # spaces around a name: its own only where it exists
    if "\x00" in name:  # os.stat raises ValueError for it: was "error: ValueError: embedded null byte"
        raise PromptFileError(f"no file at {short_path(name)}: a path cannot hold a NUL character")
    try:
        path = expand_user(name)
    except ValueError as error:  # ~name where this system knows no user "name": was a traceback
        raise PromptFileError(f"no file at {short_path(name)}: {error}") from None
    try:
        kind = path_kind(path)
        if kind is None:
            raise PromptFileError(f"no file at {short_path(path)}")
        if kind == "dir":
            raise PromptFileError(f"{short_path(path)} is a folder, not a text file")
        with path.open("rb") as f:
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)
    except OSError as error:  # unreadable; also a name longer than the system takes, which `path_kind` raises
        raise PromptFileError(f"cannot read {short_path(path)}: {error.strerror or error}") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise PromptFileError(f"{short_path(path)} is over {MAX_PROMPT_FILE_BYTES // 1_000_000} MB; "
                              "no context holds that much text")
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # Windows editors' "Unicode"
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError as error:
            raise PromptFileError(f"{short_path(path)} starts as UTF-16 but is not valid UTF-16 "
                                  f"(byte {error.start})") from None
        if "\x00" in text:  # UTF-32's mark begins as UTF-16's
            raise PromptFileError(f"{short_path(path)} is UTF-32 or binary, not text in UTF-8 or UTF-16")
    elif b"\x00" in data:
        raise PromptFileError(f"{short_path(path)} is binary (it holds NUL bytes), or UTF-16 without a "
                              "byte-order mark; save it as UTF-8")
    else:
        try:
            text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is no part of the prompt
        except UnicodeDecodeError as error:
            raise PromptFileError(f"{short_path(path)} is not valid UTF-8 (byte {error.start})") from None
    if not text.strip():
        raise PromptFileError(f"{short_path(path)} is empty")
    return text.strip()
