"""A long prefix fed in chunks (ModelRunner's `prefill_chunk`, the chat's prompt files): the same logits and
outputs as one pass where the model is batch invariant, a progress report per chunk, and an interruption
between chunks leaves a cache that is exact for what it holds."""

import pytest
import torch

from conftest import PROMPT, tiny_decoder
from gguf_models import write_tiny_gguf
from sampling import LoopSettings, autoregressive_run, speculative_run
from test_lean_forward import FUSABLE
from utils.caching import cache_length
from utils.logits_processor import GreedyProcessor
from utils.model_runner import ModelRunner
from utils.models import qkernels
from utils.models.gguf_native import build, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models.model_loader import cache_root

LONG = PROMPT + [(7 * i) % 50 + 10 for i in range(29)]  # 41 positions: chunks of 8 leave a ragged end


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    assert qkernels.ensure(cache_root()), qkernels.why()
    path = write_tiny_gguf(tmp_path_factory.mktemp("chunks") / "qwen2.gguf", "qwen2", seed=5, types=FUSABLE)
    return build(*prepare(path, KernelChoice(None, "gguf")))


class Bar:
    def __init__(self, total, log, stop_after=None):
        self.total, self.log, self.stop_after = total, log, stop_after
        log.append(("open", total))

    def update(self, n):
        self.log.append(("update", n))
        if self.stop_after is not None and sum(1 for e in self.log if e[0] == "update") >= self.stop_after:
            raise KeyboardInterrupt

    def close(self):
        self.log.append(("close",))


@torch.no_grad()
def test_chunked_prefill_gives_one_pass_logits_and_reports_each_chunk(native):
    seq = torch.tensor([LONG])
    whole = ModelRunner(native, use_cache=True).logits(seq, 1)
    log = []
    chunked = ModelRunner(native, use_cache=True, prefill_chunk=8, progress=lambda total: Bar(total, log))
    assert torch.equal(chunked.logits(seq, 1), whole)
    assert log[0] == ("open", len(LONG) - 1) and log[-1] == ("close",)
    updates = [e[1] for e in log if e[0] == "update"]
    assert updates == [8, 8, 8, 8, 8] and sum(updates) == len(LONG) - 1
    # a short continuation is one pass, without a bar
    log.clear()
    longer = torch.tensor([LONG + [12, 13]])
    assert torch.equal(chunked.logits(longer, 2), ModelRunner(native, use_cache=True).logits(longer, 2))
    assert log == []
    # a long continuation (a rollback past a sliding window's record, many drafts) is chunked without a bar: it
    # would draw over the answer being streamed (a mutation review found it drawn)
    longest = torch.tensor([LONG + [12, 13] + list(range(14, 34))])  # what was fed, 20 more
    assert torch.equal(chunked.logits(longest, 2), ModelRunner(native, use_cache=True).logits(longest, 2))
    assert log == [] and chunked.calls == 11  # 5 prompt chunks and a pass, a pass, then 3 chunks (18) and a pass


@torch.no_grad()
def test_an_interrupted_prefill_keeps_what_it_fed_and_resumes_exactly(native):
    seq = torch.tensor([LONG])
    log = []
    runner = ModelRunner(native, use_cache=True, prefill_chunk=8, progress=lambda total: Bar(total, log, 2))
    with pytest.raises(KeyboardInterrupt):
        runner.logits(seq, 1)
    assert runner.cached == 16 and log[-1] == ("close",)  # two chunks landed, the bar was closed
    assert runner.recover() and cache_length(runner.cache) == 16  # nothing past the count to cut: kept as it is
    runner.progress = None
    assert torch.equal(runner.logits(seq, 1), ModelRunner(native, use_cache=True).logits(seq, 1))


def test_a_cache_that_cannot_be_trusted_after_ctrl_c_is_not_recovered(native):
    # the session then starts the generator over: a bounded (windowed) cache forgets by its own rules, and with the
    # cache off there is nothing kept to recover
    windowed = ModelRunner(native, use_cache=True, window=8)
    windowed.logits(torch.tensor([LONG]), 1)
    assert not windowed.recover() and not ModelRunner(native, use_cache=False).recover()


def test_generators_with_chunked_runners_answer_as_with_one_pass(native):
    ar = autoregressive_run(LONG, native, 12, GreedyProcessor(), None, True).tokens
    chunked = ModelRunner(native, use_cache=True, prefill_chunk=8)
    assert autoregressive_run(LONG, native, 12, GreedyProcessor(), None, True, runner=chunked).tokens == ar
    # a float32 model is not batch invariant, but target and drafter prefill the same way in every generator
    target, drafter = tiny_decoder("qwen2", seed=1), tiny_decoder("qwen2", seed=2)
    chunk = dict(use_cache=True, prefill_chunk=8)
    ar = autoregressive_run(LONG, target, 12, GreedyProcessor(), None, True, runner=ModelRunner(target, **chunk))
    sd = speculative_run(LONG, drafter, target, GreedyProcessor(), LoopSettings(max_gen_len=12, eos_tokens_id=None),
                         use_cache=True, runners=(ModelRunner(target, **chunk), ModelRunner(drafter, **chunk)))
    assert sd.tokens == ar.tokens and len(ar.tokens) == 12


@torch.no_grad()
def test_cache_off_a_prompts_pass_is_chunked_with_progress_and_later_passes_are_whole(native):
    seq = torch.tensor([LONG])
    log = []
    runner = ModelRunner(native, use_cache=False, prefill_chunk=8, progress=lambda total: Bar(total, log))
    assert torch.equal(runner.logits(seq, 1), ModelRunner(native).logits(seq, 1))
    assert [e[1] for e in log if e[0] == "update"] == [8, 8, 8, 8, 8] and log[-1] == ("close",)
    assert runner.cache is None and runner.cached == 0  # its own cache is gone
    log.clear()
    longer = torch.tensor([LONG + [12, 13]])
    assert torch.equal(runner.logits(longer, 2), ModelRunner(native).logits(longer, 2))
    assert log == [] and runner.calls == 6 + 1  # five chunks and the last positions, then one whole pass


@torch.no_grad()
def test_cache_off_a_long_later_pass_is_read_in_pieces_without_a_bar_where_the_model_is_batch_invariant(
        native, monkeypatch):
    """A cache-off answer to a long prompt made each pass one piece of seconds, which Ctrl-C had to wait for;
    in pieces it is interruptible and faster (RESULTS.md, twenty-ninth pass), and the same bits."""
    import utils.model_runner as model_runner

    monkeypatch.setattr(model_runner, "LONG_PASS", 16)
    monkeypatch.setattr(model_runner, "LONG_PASS_CHUNK", 8)
    log = []
    runner = ModelRunner(native, use_cache=False, prefill_chunk=4, progress=lambda total: Bar(total, log))
    seq = torch.tensor([LONG])
    runner.logits(seq, 1)  # the prompt's pass: chunks of 4 with a bar
    calls, log[:] = runner.calls, []
    longer = torch.tensor([LONG + [12, 13, 14]])
    assert torch.equal(runner.logits(longer, 3), ModelRunner(native).logits(longer, 3))
    assert runner.calls - calls == 6 + 1 and log == []  # 41 positions in pieces of 8, then the last 3; no bar
    dense = tiny_decoder("llama").float()  # transformers' own model: not known batch invariant, kept whole
    runner = ModelRunner(dense, use_cache=False, prefill_chunk=4)
    runner.logits(seq.to(dense.device), 1)  # the tests' device (a GPU where SPECDEC_TEST_DEVICE says so)
    calls = runner.calls
    runner.logits(longer.to(dense.device), 3)
    assert runner.calls - calls == 1
    ar = autoregressive_run(LONG, native, 10, GreedyProcessor(), None, False,
                            runner=ModelRunner(native, prefill_chunk=4)).tokens
    monkeypatch.setattr(model_runner, "LONG_PASS", 10**9)
    assert ar == autoregressive_run(LONG, native, 10, GreedyProcessor(), None, False).tokens
