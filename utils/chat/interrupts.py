"""Ctrl-C during an answer, never lost.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. Where that is code
that reports and drops exceptions (a finaliser, a weakref or gc callback, a C API that clears errors), the
interrupt is gone and the answer runs on to its full length: the test suite once saw a `--length 3000` answer
ignore Ctrl-C for two minutes (benchmarks/RESULTS.md, issue 21, twenty-fifth pass). Here the handler also
remembers the request, and the generation loop's per-round callback raises it again (`check`), so an answer
stops within a round whatever swallowed the first raise.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

_requested = False


def _on_sigint(signum, frame) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


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
def interruptible() -> Iterator[None]:
    """Ctrl-C inside the block raises KeyboardInterrupt as usual and is remembered for `check`; outside it, SIGINT
    is handled as before (at the prompt, Python's default: input() raises and the REPL leaves). A no-op off the main
    thread, where signal handlers cannot be set."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested = False
