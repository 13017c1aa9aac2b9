"""Debug output of speculative steps: accepted drafts in green, rejected in red, the target's token in blue."""

from __future__ import annotations

import os
import sys
from typing import Callable

from termcolor import colored


def on_terminal(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()  # (None: started with the stream closed)


def bars_shown() -> bool:
    """Progress bars go to a terminal only: in a file or a pipe their carriage returns and the spaces that erase
    them stay, one line of kilobytes."""
    return on_terminal(sys.stderr)


def color_enabled(stream=None) -> bool:
    """Colours follow the terminal: NO_COLOR turns them off, FORCE_COLOR forces them, otherwise only on a TTY."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return on_terminal(stream)


def one_line(error: BaseException) -> str:
    """An exception's message on one line, at most 300 characters: what the user sees instead of a traceback."""
    text = " ".join(str(error).split())
    return (text[:300] + "…") if len(text) > 300 else (text or type(error).__name__)


def paint(text: str, color: str, **kwargs) -> str:
    return colored(text, color, force_color=True, **kwargs) if color_enabled() else text


def token_text(tokenizer, token: int) -> str:
    if tokenizer is None:
        return f"[{token}]"
    return tokenizer.decode([token])


def format_round(tokenizer, drafts: list[int], accepted: int, tokens: list[int]) -> str:
    """One round: accepted drafts green, rejected drafts red and struck, the target's own token blue. Without
    colour (NO_COLOR, a pipe) the drafts are marked `[+kept+]` and `[-rejected-]`, the target's token plain."""
    kept = drafts[:accepted]
    rejected = drafts[accepted:]
    if color_enabled():
        parts = [paint(token_text(tokenizer, t), "green") for t in kept]
        parts += [paint(token_text(tokenizer, t), "red", attrs=["strike"]) for t in rejected]
    else:
        parts = [f"[+{token_text(tokenizer, t)}+]" for t in kept] + [f"[-{token_text(tokenizer, t)}-]" for t in rejected]
    if len(tokens) > len(kept):
        parts.append(paint(token_text(tokenizer, tokens[len(kept)]), "blue"))
    return "".join(parts) if tokenizer is not None else " ".join(parts)


def debug_printer(tokenizer, stream=None) -> Callable:
    def on_round(step) -> None:
        print(format_round(tokenizer, step.drafts, step.accepted, step.tokens), file=stream or sys.stdout, flush=True)

    return on_round


_notes_said: set[str] = set()


def note_once(text: str) -> None:
    """Prints a note on stderr the first time it is said in this process (two models loaded, one note)."""
    if text not in _notes_said:
        _notes_said.add(text)
        print(text, file=sys.stderr, flush=True)
