"""ModelRunner at its boundaries: a prefix exactly one chunk long, a later pass exactly LONG_PASS wide, a window's
rollback of exactly what it holds, a reuse whose prompt is a prefix of what the cache read."""

import pytest
import torch

from conftest import tiny_decoder
from utils.model_runner import ModelRunner, common_prefix_length

SEQ = [5 + (7 * i) % 40 for i in range(40)]


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama", seed=0, init=0.3)


class Bar:
    def __init__(self, log):
        self.log = log

    def update(self, n):
        self.log.append(n)

    def close(self):
        pass


@pytest.mark.parametrize("use_cache", [False, True])
@torch.no_grad()
def test_a_prefix_of_exactly_one_chunk_is_read_in_one_pass(model, use_cache):
    """`prefill_chunk` positions before the last: one pass, no chunk and no bar; one more: a chunk first."""
    for before, calls, updates in ((8, 1, []), (9, 3, [8, 1])):
        log = []
        runner = ModelRunner(model, use_cache=use_cache, prefill_chunk=8, progress=lambda total: Bar(log))
        seq = torch.tensor([SEQ[: before + 1]])
        torch.testing.assert_close(runner.logits(seq, 1), ModelRunner(model).logits(seq, 1))
        assert runner.calls == calls and log == updates


@torch.no_grad()
def test_a_later_pass_of_exactly_long_pass_positions_is_whole(model, monkeypatch):
    """Cache off, a later pass is read in pieces only when it is wider than LONG_PASS."""
    import utils.model_runner as model_runner

    monkeypatch.setattr(model_runner, "LONG_PASS", 16)
    monkeypatch.setattr(model_runner, "LONG_PASS_CHUNK", 8)
    monkeypatch.setattr(model, "batch_invariant", True, raising=False)
    for width, calls in ((16, 1), (17, 3)):
        runner = ModelRunner(model, use_cache=False, prefill_chunk=4)
        runner.logits(torch.tensor([SEQ[:5]]), 1)  # the prompt's pass
        before = runner.calls
        seq = torch.tensor([SEQ[:width]])
        torch.testing.assert_close(runner.logits(seq, 2), ModelRunner(model).logits(seq, 2))
        assert runner.calls - before == calls
    log = []  # a prompt's pass, however long, goes in `prefill_chunk` pieces with a bar
    runner = ModelRunner(model, use_cache=False, prefill_chunk=4, progress=lambda total: Bar(log))
    runner.logits(torch.tensor([SEQ[:21]]), 1)
    assert runner.calls == 5 + 1 and log == [4, 4, 4, 4, 4]


def test_common_prefix_of_a_prefix_is_its_length():
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([1, 2, 3], [1, 4, 3]) == 1
    assert common_prefix_length([], [1]) == 0


@torch.no_grad()
def test_a_window_rolled_back_by_exactly_its_recent_entries_keeps_its_sinks_instead_of_refilling(model):
    """A windowed cache (4 sinks + 4 recent) rolled back by all its recent entries cuts them and reads on from its
    sinks (one position fed, as the module's docstring says: r-1 recent positions fewer); only past them it
    refills a whole window."""
    from utils.caching import cache_length

    seq = torch.tensor([SEQ])
    runner = ModelRunner(model, use_cache=True, window=8)
    for n in (20, 21):  # holds the sinks and 17-20
        runner.logits(seq[:, :n], 1)
    assert runner.cache.recent_length() == 4
    out = runner.logits(seq[:, :18], 1)  # back to 17: the 4 recent entries go, the sinks stay
    assert cache_length(runner.cache) == 4 + 1
    read = torch.tensor([0, 1, 2, 3, 17])
    expected = model(input_ids=seq[:, read], position_ids=read[None], attention_mask=torch.ones(1, 5, dtype=torch.long))
    torch.testing.assert_close(out, expected.logits[:, -1:])


@pytest.mark.parametrize("use_cache", [False, True])
@torch.no_grad()
def test_a_sequence_shorter_than_the_window_is_read_whole_and_once(model, use_cache):
    """Within the window (sinks included) a windowed runner reads every position once, as an unwindowed one."""
    widths = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    try:
        for n, k in ((6, 1), (8, 1), (9, 2), (5, 3)):
            seq = torch.tensor([SEQ[:n]])
            widths.clear()
            out = ModelRunner(model, use_cache=use_cache, window=8).logits(seq, k)
            assert widths == [n]
            torch.testing.assert_close(out, ModelRunner(model, use_cache=use_cache).logits(seq, k))
    finally:
        hook.remove()


@torch.no_grad()
def test_reuse_keeps_a_window_that_still_holds_what_the_next_query_sees(model):
    """A windowed runner (4 sinks + 4 recent) holding 17-20: a next turn that shares 20 positions keeps them (its
    first query, at 20, sees 17-19), and answers as a runner that rolled back by one; sharing 19 it starts over."""
    seq = torch.tensor([SEQ])
    turn = SEQ[:20] + [60]

    def after_two_passes():
        runner = ModelRunner(model, use_cache=True, window=8)
        for n in (20, 21):
            runner.logits(seq[:, :n], 1)
        return runner

    kept = after_two_passes()
    assert kept.reuse(turn) == 20
    rolled = after_two_passes()
    rolled.new_prompt = True
    torch.testing.assert_close(kept.logits(torch.tensor([turn]), 1), rolled.logits(torch.tensor([turn]), 1))
    assert after_two_passes().reuse(SEQ[:19] + [60]) == 0
    short = ModelRunner(model, use_cache=True, window=8)
    short.logits(seq[:, :6], 1)  # within the window: nothing forgotten, any shared prefix is kept
    assert short.reuse(SEQ[:5] + [60]) == 5
    torch.testing.assert_close(short.logits(torch.tensor([SEQ[:5] + [60]]), 1),
                               ModelRunner(model, use_cache=True, window=8).logits(torch.tensor([SEQ[:5] + [60]]), 1))


@torch.no_grad()
def test_with_the_cache_on_any_long_pass_is_fed_in_chunks(model):
    """The module's docstring: a prompt's pass, and with the cache on any long one, is fed in `prefill_chunk`
    pieces."""
    runner = ModelRunner(model, use_cache=True, prefill_chunk=4)
    runner.logits(torch.tensor([SEQ[:5]]), 1)  # the prompt: 4 positions before its last, one pass
    assert runner.calls == 1
    seq = torch.tensor([SEQ[:16]])
    torch.testing.assert_close(runner.logits(seq, 1), ModelRunner(model).logits(seq, 1))
    assert runner.calls == 1 + 3 + 1  # positions 5-14 in chunks of 4, 4 and 2, then 15


def test_a_window_as_long_as_the_drafters_context_is_taken(model):
    from utils.model_runner import check_window

    limit = model.config.max_position_embeddings
    assert check_window(limit, model) == limit and check_window(8, model) == 8
    for bad in (limit + 1, 7):
        with pytest.raises(ValueError):
            check_window(bad, model)
