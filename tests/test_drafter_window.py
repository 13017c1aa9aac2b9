"""`--drafter-window N`: the drafter reads 4 sinks and its N-4 latest positions, the target reads everything, so
speculative decoding still gives exactly the target's output (greedy: AR's tokens; sampled: its distribution)."""

import copy
import io
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import PROMPT, ids, tiny_decoder
from sampling import LoopSettings, autoregressive_generate, speculative_run
from test_distribution import RememberingRunner, chi_square_pvalue
from utils.logits_processor import GreedyProcessor, MultinomialProcessor
from utils.caching import BoundedCache, cache_length
from utils.model_runner import ModelRunner

LONG = PROMPT * 3  # 36 positions: a window of 8 or 12 leaves most of the prompt unread


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("llama", seed=0, init=0.3)


@pytest.fixture(scope="module")
def reference(target):
    return autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None)


class Widths:
    """The widths of the passes a model runs (its embedding's input), to show what the drafter reads."""

    def __init__(self, model):
        self.seen: list[int] = []
        model.get_input_embeddings().register_forward_hook(lambda m, args, out: self.seen.append(args[0].shape[1]))


def run(target, drafter, window, use_cache, gamma=3, processor=None, length=30):
    settings = LoopSettings(max_gen_len=length, gamma=gamma, eos_tokens_id=None)
    return speculative_run(LONG, drafter, target, processor or GreedyProcessor(), settings, use_cache,
                           drafter_window=window)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("window", [8, 12])
def test_greedy_sd_equals_ar_and_the_window_bites(target, reference, use_cache, gamma, window):
    drafter = copy.deepcopy(target)  # the target as its own drafter: every draft accepted, until a window cuts it
    full = run(target, drafter, 0, use_cache, gamma)
    assert full.tokens == reference and full.acceptance_rate == 1.0
    widths = Widths(drafter)
    windowed = run(target, drafter, window, use_cache, gamma)
    assert windowed.tokens == reference
    assert 0 < windowed.acceptance_rate < 1.0  # the drafter really read less than the target
    assert max(widths.seen) <= window  # never a pass over the whole prompt
    if use_cache:  # a prefill of the window, then one position per pass (and a refill after a long rollback)
        assert sum(widths.seen) < window * windowed.drafter_calls / 2


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_default_window_is_32_with_the_cache_off_and_none_with_it_on(target, use_cache):
    # cache off, each drafter pass reads its whole window again, so the default bounds it (`window_for`); the
    # prompt here is 36 positions, so a pass over all of it would be wider than the window
    from utils.model_runner import CACHE_OFF_WINDOW, window_for

    assert CACHE_OFF_WINDOW == 32 and window_for(None, use_cache, target) == (0 if use_cache else 32)
    assert window_for(12, use_cache, target) == 12 and window_for(0, use_cache, target) == 0
    drafter = copy.deepcopy(target)
    widths = Widths(drafter)
    auto = run(target, drafter, None, use_cache)
    assert auto.tokens == autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None)
    assert (max(widths.seen) <= 32) == (not use_cache)  # cache on, its prefill reads the whole prompt


def test_the_default_window_needs_a_drafter_that_can_take_it():
    from conftest import tiny_encoder_decoder
    from utils.model_runner import window_for

    assert window_for(None, False, tiny_encoder_decoder("t5", seed=0)) == 0  # no window for an encoder-decoder
    short = tiny_decoder("llama", seed=0)
    short.config.max_position_embeddings = 16
    assert window_for(None, False, short) == 0  # nor past the drafter's context


def test_the_simple_api_takes_a_window(target, reference):
    from sampling import speculative_generate

    tokens, rate = speculative_generate(LONG, copy.deepcopy(target), target, gamma=3, max_gen_len=30,
                                        eos_tokens_id=None, use_cache=True, drafter_window=8)
    assert tokens == reference and rate < 1.0


def test_a_distant_drafter_rolls_back_past_its_window(target, reference):
    # A window of 8 keeps 3 recent entries between passes; gamma 6 rolls back up to 5: the cache refills.
    drafter = tiny_decoder("llama", seed=1, init=0.3)
    result = run(target, drafter, 8, True, gamma=6)
    assert result.tokens == reference and result.acceptance_rate < 0.5


@pytest.mark.parametrize("name", ["multinomial", "temperature"])
def test_sampling_keeps_the_targets_distribution(name):
    vocab, prompt = 12, [3, 4, 5, 3, 4, 6, 7, 3, 4, 5, 8, 3, 4]  # 13 positions against a window of 8
    target = tiny_decoder("llama", seed=3, vocab=vocab, init=0.6)
    processor = MultinomialProcessor(1.0 if name == "multinomial" else 0.6)
    settings = LoopSettings(max_gen_len=2, gamma=2, eos_tokens_id=-1, first_target=False)
    # The target's own copy drafts, with a window: close enough to be accepted often, wrong often enough to
    # exercise the residual; a wrong rule would show in the chi-square.
    runners = RememberingRunner(target), RememberingRunner(copy.deepcopy(target), window=8)
    torch.manual_seed(0)
    samples, rates = [], []
    for _ in range(3000):
        result = speculative_run(prompt, runners[1].model, target, processor, settings, runners=runners,
                                 drafter_window=8)
        samples.append(tuple(result.tokens))
        rates.append(result.acceptance_rate)
    exact = {(): 1.0}
    with torch.no_grad():
        for _ in range(2):
            prefixes = list(exact)
            nexts = processor(target(ids([prompt + list(x) for x in prefixes])).logits[:, -1])
            exact = {x + (b,): exact[x] * float(nexts[i, b]) for i, x in enumerate(prefixes) for b in range(vocab)}
    assert 0.05 < sum(rates) / len(rates) < 0.98  # drafts accepted and rejected: both rules run
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_translated_drafts_under_a_window():
    from test_translating_drafter import PROMPT_TEXT, RELABELLED, TARGET_TOKENIZER, model_for, relabelled_copy, \
        word_tokenizer

    target = model_for(TARGET_TOKENIZER, seed=0, init=0.3)
    prompt = TARGET_TOKENIZER(" ".join([PROMPT_TEXT] * 3))["input_ids"]
    reference = autoregressive_generate(prompt, target, max_gen_len=30, eos_tokens_id=None)
    for use_cache in (False, True):
        result = speculative_run(prompt, relabelled_copy(target), target, None,
                                 LoopSettings(max_gen_len=30, gamma=4, eos_tokens_id=None), use_cache,
                                 tokenizer=TARGET_TOKENIZER, drafter_tokenizer=word_tokenizer(RELABELLED),
                                 drafter_window=8)
        assert result.tokens == reference and result.acceptance_rate < 1.0


def test_chat_turns_with_a_windowed_drafter(tmp_path):
    from cli_models import write_tiny_model
    from utils.chat.session import Session
    from utils.chat.settings import Settings
    from utils.models.model_loader import load_model

    write_tiny_model(tmp_path / "m", context=400)
    model, tokenizer = load_model(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    drafter = copy.deepcopy(model)
    chat = Session(model, drafter, tokenizer, Settings(length=12, use_cache=True, gamma=3, drafter_window=16))
    chat.settings.enabled.update(drafter=False, ngram=False)
    chat.out = io.StringIO()
    for i in range(6):
        reports = {r.generator: r for r in chat.answer(f"w{i} w{i * 3 % 7} hello world write code " * 4)}
        assert reports["speculative"].token_ids == reports["target"].token_ids
        assert reports["speculative"].error is None
        assert cache_length(chat.kept["speculative"][1].cache) <= 16 + 3  # 4 sinks + 11, plus one pass
    cut = chat.kept["speculative"][1].cached - cache_length(chat.kept["speculative"][1].cache)
    assert cut > 100  # the conversation is long, and the drafter's cache holds only its window


def test_bad_windows_are_refused(target):
    with pytest.raises(ValueError, match="at least 8 positions"):
        ModelRunner(target, window=3)
    with pytest.raises(ValueError, match="larger than the drafter's context"):
        ModelRunner(target, window=10_000)
    from conftest import tiny_encoder_decoder

    with pytest.raises(ValueError, match="decoder-only"):
        ModelRunner(tiny_encoder_decoder("t5"), window=16, encoder_input_ids=[1, 2, 3])


def native_pair():
    """Two copies of a tiny GGUF model on our kernels, row-wise attention and the lean forward, as the chat runs
    them."""
    from gguf_models import write_tiny_gguf
    from test_lean_forward import FUSABLE
    from utils.models import qkernels
    from utils.models.gguf_native import build, prepare
    from utils.models.kernel_choice import KernelChoice
    from utils.models.model_loader import cache_root

    assert qkernels.ensure(cache_root()), qkernels.why()
    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_gguf(Path(folder) / "qwen2.gguf", "qwen2", seed=5, types=FUSABLE)
        return tuple(build(*prepare(path, KernelChoice(None, "gguf"))) for _ in range(2))


def test_native_mode_with_chunked_prefills():
    from test_prefill_chunks import LONG as CHUNKED

    target, drafter = native_pair()
    prompt = CHUNKED * 2
    reference = autoregressive_generate(prompt, target, max_gen_len=20, eos_tokens_id=None)
    settings = LoopSettings(max_gen_len=20, gamma=3, eos_tokens_id=None)
    runners = ModelRunner(target, use_cache=True, prefill_chunk=8), \
        ModelRunner(drafter, use_cache=True, prefill_chunk=8, window=12)
    result = speculative_run(prompt, drafter, target, GreedyProcessor(), settings, runners=runners)
    assert result.tokens == reference and result.acceptance_rate < 1.0
    assert cache_length(runners[1].cache) <= 12 + 3


@torch.no_grad()
def test_a_windowed_cache_reads_as_a_fresh_window_after_a_skip_ahead_or_a_long_rollback(target):
    """A windowed runner (8: 4 sinks + 4 recent) that skips past its window forgets all but its sinks, and one
    rolled back past its recent entries refills: either way its next pass reads what a fresh runner reads."""
    seq = torch.tensor([[5 + (7 * i) % 40 for i in range(40)]], device=target.device)

    def fresh(n):
        return ModelRunner(target, use_cache=True, window=8).logits(seq[:, :n], 1)

    skipped = ModelRunner(target, use_cache=True, window=8)
    skipped.logits(seq[:, :20], 1)
    torch.testing.assert_close(skipped.logits(seq[:, :30], 1), fresh(30))
    assert cache_length(skipped.cache) == 8
    rolled = ModelRunner(target, use_cache=True, window=8)
    for n in (20, 21):  # holds the sinks and 4 recent entries
        rolled.logits(seq[:, :n], 1)
    torch.testing.assert_close(rolled.logits(seq[:, :17], 1), fresh(17))  # 5 back: past the recent entries
    assert cache_length(rolled.cache) == 8


@torch.no_grad()
def test_a_cache_off_window_attends_to_its_sinks(target):
    """Cache off, a window's pass feeds position ids that jump (0 1 2 3 16 ...), which transformers would read as
    packed sequences without a mask: the recent positions must still attend to the sinks, as with the cache on."""
    seq = torch.tensor([[5 + (7 * i) % 40 for i in range(40)]], device=target.device)
    off = ModelRunner(target, use_cache=False, window=8).logits(seq[:, :20], 1)
    on = ModelRunner(target, use_cache=True, window=8).logits(seq[:, :20], 1)  # the same 8 positions, one pass
    torch.testing.assert_close(off, on)


@pytest.mark.parametrize("ahead", [2, 3, 4, 5, 6])
@torch.no_grad()
def test_a_windowed_cache_fed_several_positions_reads_only_the_first_querys_window(target, ahead):
    """A pass that feeds `ahead` new positions (a drafter catching up after a full acceptance) forgets the held
    entries older than its first query's window, and only those: 3 and 4 ahead read a stale one before. The entries
    it keeps are those of its earlier pass (computed then, with what that pass read), so the reference is a cache
    fed the same first pass and cut by hand to the sinks and the window's positions."""
    seq = torch.tensor([[5 + (7 * i) % 40 for i in range(40)]], device=target.device)
    runner = ModelRunner(target, use_cache=True, window=8)
    runner.logits(seq[:, :20], 1)  # feeds 0-3 and 16-19
    first_recent = 20 + ahead - 4  # the last query's window: its position and the 3 before it
    new = torch.arange(max(20, first_recent), 20 + ahead)  # positions skipped are never computed
    cache = BoundedCache(4, 4)
    first = torch.tensor([0, 1, 2, 3, 16, 17, 18, 19])
    target(input_ids=seq[:, first], position_ids=first[None], past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        layer.evict(4, max(20 - first_recent, 0))
    expected = target(input_ids=seq[:, new], position_ids=new[None], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(runner.logits(seq[:, :20 + ahead], 1), expected[:, -1:])
    assert cache_length(runner.cache) == cache_length(cache) == 8
