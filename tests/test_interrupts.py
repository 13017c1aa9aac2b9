"""Edges of utils/chat/interrupts.py (found by a mutation review): a request is spent once raised again, forgotten
after its block, and an inherited SIG_IGN (only that) gives way to Python's handler."""

import signal

import pytest

from utils.chat import interrupts


@pytest.fixture(autouse=True)
def restore_sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_swallowed_press_is_raised_again_once_and_forgotten_after_its_block():
    with interrupts.interruptible():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # swallowed, as by a finaliser
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.check()  # spent: not raised a second time
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass  # swallowed, and the block ends before any round checks it
    interrupts.check()  # the next answer does not stop for it


def test_an_inherited_ignore_gives_way_to_pythons_handler_and_nothing_else_does():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupts.take_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def own(signum, frame):
        pass

    signal.signal(signal.SIGINT, own)
    interrupts.take_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is own
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    interrupts.take_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL


def test_at_the_prompt_a_handler_of_someone_elses_is_left_alone():
    def own(signum, frame):
        pass

    signal.signal(signal.SIGINT, own)
    interrupts.at_prompt()  # only the chat's absorbing handler is replaced
    assert signal.getsignal(signal.SIGINT) is own
