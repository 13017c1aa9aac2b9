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
    """Colours follow the terminal the text goes to (stdout unless told): NO_COLOR turns them off, FORCE_COLOR
    forces them, otherwise only on a TTY that is not TERM=dumb (Emacs' shell, some CI consoles), as termcolor."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return takes_escapes(stream)


def takes_escapes(stream) -> bool:
    """A terminal that interprets escape sequences (colours, clearing): not a file or pipe, not TERM=dumb."""
    return on_terminal(stream) and os.environ.get("TERM") != "dumb"


def one_line(error: BaseException) -> str:
    """An exception's message on one line, at most 300 characters: what the user sees instead of a traceback."""
    text = " ".join(str(error).split())
    return (text[:300] + "…") if len(text) > 300 else (text or type(error).__name__)


def paint(text: str, color: str, stream=None, **kwargs) -> str:
    """`text` in `color` where `stream` (stdout unless told), which it is printed to, shows colours."""
    return colored(text, color, force_color=True, **kwargs) if color_enabled(stream) else text


class RoundTexts:
    """Each token's text as it reads after the answer so far. Decoded alone, a token holding part of a multi-byte
    character (an emoji's first bytes, in a byte-level vocabulary) showed as U+FFFD in every debug round: the
    character now shows with the token that completes it. Without a tokenizer, token ids."""

    CONTEXT = 8  # tokens of the answer decoded before a round's: enough for any character's bytes

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.answer: list[int] = []  # the last `CONTEXT` tokens kept

    def round(self, kept: list[int], rejected: list[int], target: list[int]) -> tuple[list[str], list[str], list[str]]:
        """The texts of a round's kept drafts, rejected drafts (read after the kept ones) and the target's token."""
        if self.tokenizer is None:
            return ([f"[{t}]" for t in kept], [f"[{t}]" for t in rejected], [f"[{t}]" for t in target])
        context = self.answer
        texts = self.pieces(context, kept + target, complete_last=False)  # its character may end next round
        rejected_texts = self.pieces(context + kept, rejected, complete_last=True)  # never completed: shows U+FFFD
        self.answer = (self.answer + kept + target)[-self.CONTEXT:]
        return texts[: len(kept)], rejected_texts, texts[len(kept):]

    def held(self) -> str:
        """What the rounds have not shown: the bytes of a character the answer ended inside (U+FFFD, as the
        answer's text and report have it), else ''."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.answer)
        return text[len(text.rstrip("\ufffd")):]

    def pieces(self, context: list[int], new: list[int], complete_last: bool) -> list[str]:
        shown = self.tokenizer.decode(context).rstrip("\ufffd")
        texts = []
        for i, token in enumerate(new):
            text = self.tokenizer.decode(context + new[: i + 1])
            if not (complete_last and i == len(new) - 1):
                text = text.rstrip("\ufffd")  # part of a character: it shows with the token that completes it
            if text.startswith(shown):
                texts.append(text[len(shown):])
                shown = text
            else:  # a decoder that rewrites what came before (clean-up of spaces): the token alone
                texts.append(self.tokenizer.decode([token]))
        return texts


def format_round(texts: RoundTexts, drafts: list[int], accepted: int, tokens: list[int], stream=None) -> str:
    """One round, for `stream`: accepted drafts green, rejected drafts red and struck, the target's own token blue.
    Without colour (NO_COLOR, a pipe) the drafts are marked `[+kept+]` and `[-rejected-]`, the target's plain."""
    kept, rejected, own = texts.round(drafts[:accepted], drafts[accepted:], tokens[accepted:accepted + 1])
    if color_enabled(stream):
        parts = [paint(t, "green", stream) for t in kept]
        parts += [paint(t, "red", stream, attrs=["strike"]) for t in rejected]
    else:
        parts = [f"[+{t}+]" for t in kept] + [f"[-{t}-]" for t in rejected]
    parts += [paint(t, "blue", stream) for t in own]
    return "".join(parts) if texts.tokenizer is not None else " ".join(parts)


def debug_printer(tokenizer, stream=None) -> Callable:
    texts = RoundTexts(tokenizer)  # one generation's

    def on_round(step) -> None:
        out = stream or sys.stdout
        print(format_round(texts, step.drafts, step.accepted, step.tokens, out), file=out, flush=True)

    return on_round


_notes_said: set[str] = set()


def note_once(text: str) -> None:
    """Prints a note on stderr the first time it is said in this process (two models loaded, one note)."""
    if text not in _notes_said:
        _notes_said.add(text)
        print(text, file=sys.stderr, flush=True)
