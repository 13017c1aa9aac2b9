"""What is at a path the user named, for one-line errors: never a traceback, and the reason never cut off."""

from __future__ import annotations

import os
import stat
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
