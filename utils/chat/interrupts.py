"""Ctrl-C during an answer, never lost.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. Where that is code
that reports and drops exceptions (a finaliser, a weakref or gc callback, a C API that clears errors), the
interrupt is gone and the answer runs on to its full length: the test suite once saw a `--length 3000` answer
ignore Ctrl-C for two minutes (benchmarks/RESULTS.md, issue 21, twenty-fifth pass). Here the handler also
remembers the request, and the generation loop's per-round callback raises it again (`check`), so an answer
stops within a round whatever swallowed the first raise.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

BURST_S = 1.0  # a press this soon after the prompt came back from a stopped answer is the same impatient burst

_requested = False
_absorbing = False  # `interruptible(absorb_until_prompt=True)`: presses after the first are absorbed
_prompt_back_at = -math.inf  # when `at_prompt` last took Ctrl-C back from `_absorb`


def _on_sigint(signum, frame) -> None:
    global _requested
    _requested = True
    if _absorbing:  # not raised again while this one unwinds (the test suite saw the chat hang then)
        signal.signal(signal.SIGINT, _absorb)
    raise KeyboardInterrupt


def _absorb(signum, frame) -> None:
    """A press after the one that stopped the chat's answer, while that one is reported: the same request."""


def at_prompt() -> None:
    """Ctrl-C at the prompt leaves again (Python's handler), once a stopped answer has been reported."""
    global _prompt_back_at
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _absorb:
        _prompt_back_at = time.monotonic()  # first: a press as the handler changes is still the burst
        signal.signal(signal.SIGINT, signal.default_int_handler)


def same_burst() -> bool:
    """Whether a Ctrl-C at the prompt came within `BURST_S` of the prompt's return after a stopped answer: the
    double press that stopped it, not a request to leave."""
    return time.monotonic() - _prompt_back_at < BURST_S


def check() -> None:
    """Raises KeyboardInterrupt if Ctrl-C came during this answer (once: the request is then spent)."""
    global _requested
    if _requested:
        _requested = False
        raise KeyboardInterrupt


def take_ctrl_c() -> None:
    """Ctrl-C at the prompt leaves, as the chat says, even in a process started with SIGINT ignored (inherited: a
    shell's background job, a child forked while its parent sat in C's system(); the test suite's workers once passed
    it on, from code not found). Python keeps an inherited SIG_IGN, so Ctrl-C stopped answers (`interruptible`) but
    not the session. Installs Python's own handler in that case only (main thread: where handlers can be set)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def interruptible(absorb_until_prompt: bool = False) -> Iterator[None]:
    """Ctrl-C inside the block raises KeyboardInterrupt as usual and is remembered for `check`; outside it, SIGINT
    is handled as before (at the prompt, Python's default: input() raises and the REPL leaves). With
    `absorb_until_prompt` (the chat's answers), presses after the first are absorbed until `at_prompt`: an
    impatient double press came while the chat reported the first, outside any handler of its own, and ended the
    session. (A first raise that something swallowed still stops the answer at its next round: `check`.) A no-op
    off the main thread, where signal handlers cannot be set."""
    global _requested, _absorbing
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested, _absorbing = False, absorb_until_prompt
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _on_sigint:  # no press: as before; else absorbed till the prompt
            signal.signal(signal.SIGINT, previous)
        _requested = _absorbing = False
