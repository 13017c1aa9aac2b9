"""What is at a path the user named, for one-line errors: never a traceback, and the reason never cut off."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def expand_user(text: str) -> Path:
    """`text` as a path, `~` and `~user` expanded; ValueError where `~user` names no user of this system (pathlib
    raises a RuntimeError there)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ValueError(f"{text.split(os.sep)[0]} names no user of this system") from None


def path_kind(path) -> str | None:
    """"dir", "file" or "other" (a FIFO, a device) for what is at `path`; None where nothing is (a dangling link
    too). OSError where the system refuses to look (a name longer than it takes, a loop of links): pathlib's
    `exists`/`is_dir` raise that before Python 3.13 and answer False after, which would read as "no file"."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def short_path(path) -> str:
    """A path for a one-line error, its middle cut where it is long: `one_line` keeps 300 characters, and the
    reason comes after the path (a 5000-character name hid "File name too long")."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}…{text[-40:]} ({len(text)} characters)"


def printable_path(path) -> str:
    """A path as a message can print it: the bytes of a name that is not UTF-8 (a Latin-1 one), which reach Python
    as lone surrogates, shown as U+FFFD."""
    return os.fsencode(str(path)).decode("utf-8", "replace")


def unwritable(path: str) -> str | None:
    """Why a file could not be written at `path` (an n-gram cache, a benchmark's head; checked before the models
    load), or None. Such files are written beside themselves and renamed into place, so the folder must take new
    files."""
    if not path.strip():
        return "give a file's path"
    target = Path(os.path.realpath(path))
    try:
        if path_kind(target) == "dir":
            return f"{short_path(target)} is a folder; give a file's path"
        if path_kind(target.parent) != "dir":
            return f"no folder {short_path(target.parent)} to keep {short_path(target.name)} in"
    except OSError as error:  # a name longer than the system takes
        return f"cannot use {short_path(target)}: {error.strerror or error}"
    if not os.access(target.parent, os.W_OK | os.X_OK):
        return f"cannot write in {short_path(target.parent)}"
    try:  # root passes `access` everywhere: a file made and removed is the proof (/proc, a read-only mount)
        handle, probe = tempfile.mkstemp(prefix=f".{target.name[:40]}.", suffix=".probe", dir=target.parent)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return f"cannot write in {short_path(target.parent)}: {error.strerror or error}"
    return None
