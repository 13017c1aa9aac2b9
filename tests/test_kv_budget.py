"""The KV budget: attention sinks plus a recent window, with a cache that forgets the rest and still rolls back
exactly, so greedy speculative decoding equals autoregressive decoding under the same budget."""

import pytest
import torch

from conftest import PROMPT, tiny_decoder
from ngram_assisted import NGramStorage, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, autoregressive_run, speculative_generate
from utils.caching import BoundedCache, cache_length
from utils.model_runner import ModelRunner
from utils.models.rowwise_attention import use_kv_budget

SINKS, BUDGET = 2, 10  # a window of 8: the tiny models' 40-token answers run far past it
LONG_PROMPT = PROMPT * 2


def budgeted(seed: int, budget: int = BUDGET):
    model = tiny_decoder("llama", seed=seed)
    use_kv_budget(model, budget, sinks=SINKS)
    return model


@pytest.fixture(scope="module")
def target():
    return budgeted(0)


@pytest.fixture(scope="module")
def reference(target):
    return autoregressive_generate(LONG_PROMPT, target, max_gen_len=40, eos_tokens_id=None)


def test_the_budget_changes_what_is_attended(target, reference):
    full = autoregressive_generate(LONG_PROMPT, tiny_decoder("llama", seed=0), max_gen_len=40, eos_tokens_id=None)
    assert full != reference  # the window really bounds attention (else the tests below prove nothing)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_sd_and_nasd_equal_ar_under_the_same_budget(target, reference, use_cache, gamma):
    drafter = budgeted(1)  # another model: its drafts are often rejected, so rollbacks happen
    assert autoregressive_generate(LONG_PROMPT, target, max_gen_len=40, eos_tokens_id=None,
                                   use_cache=use_cache) == reference
    sd, rate = speculative_generate(LONG_PROMPT, drafter, target, gamma=gamma, max_gen_len=40, eos_tokens_id=None,
                                    use_cache=use_cache)
    assert sd == reference and 0 < rate < 1
    nasd, _ = ngram_assisted_speculative_generate(LONG_PROMPT, NGramStorage(3, 64), target, gamma=gamma,
                                                  max_gen_len=40, eos_tokens_id=None, use_cache=use_cache)
    assert nasd == reference


def test_the_cache_stays_bounded(target):
    runner = ModelRunner(target, use_cache=True)
    result = autoregressive_run(LONG_PROMPT, target, 60, None, None, True, runner=runner)
    assert isinstance(runner.cache, BoundedCache) and len(result.tokens) == 60
    assert runner.cached == len(LONG_PROMPT) + 59
    assert cache_length(runner.cache) <= BUDGET  # sinks + window - 1 kept, plus the last pass's one token


def test_reuse_across_turns_under_a_budget(target, reference):
    runner = ModelRunner(target, use_cache=True)
    first = autoregressive_run(LONG_PROMPT, target, 20, None, None, True, runner=runner).tokens
    # The next turn shares the whole first turn: the window is still there, the cache is kept.
    follow = LONG_PROMPT + first + [5, 6, 7]
    assert runner.reuse(follow) == len(LONG_PROMPT) + 19 > BUDGET  # kept, though most of it was forgotten
    again = autoregressive_run(follow, target, 10, None, None, True, runner=runner).tokens
    assert again == autoregressive_generate(follow, target, max_gen_len=10, eos_tokens_id=None)
    # A turn that parts early, inside what was forgotten: the cache starts over, the answer is still exact.
    other = LONG_PROMPT[:5] + [9, 9, 9]
    assert runner.reuse(other) == 0
    assert autoregressive_run(other, target, 10, None, None, True, runner=runner).tokens == \
        autoregressive_generate(other, target, max_gen_len=10, eos_tokens_id=None)


def test_a_budget_too_small_is_refused():
    with pytest.raises(ValueError, match="at least 8 positions"):
        use_kv_budget(tiny_decoder("llama", seed=0), 6, sinks=4)
    with pytest.raises(ValueError, match="sliding window"):
        use_kv_budget(tiny_decoder("mistral", seed=0), 16)
    # Falcon sets no attention implementation: it was refused as "(a sliding window)" too, which it has none of
    from transformers import FalconConfig, FalconForCausalLM

    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    with pytest.raises(ValueError, match=r"cannot use \(its attention cannot be replaced\)"):
        use_kv_budget(falcon.eval(), 16)


def test_a_long_chat_under_a_budget_keeps_its_caches_bounded(tmp_path):
    import io

    from cli_models import write_tiny_model
    from utils.chat.session import Session
    from utils.chat.settings import Settings
    from utils.models.model_loader import load_model

    write_tiny_model(tmp_path / "m", context=160)
    model, tokenizer = load_model(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    use_kv_budget(model, 24)
    chat = Session(model, model, tokenizer, Settings(length=12, use_cache=True, gamma=3))
    chat.out = io.StringIO()
    for i in range(40):
        reports = chat.answer(f"w{i % 50} w{(i * 7) % 50} hello world write code")
        assert all(r.error is None and r.tokens_generated for r in reports)
        held = [cache_length(r.cache) for kept in chat.kept.values() for r in (kept if isinstance(kept, tuple) else [kept])]
        # sinks + window - 1, gamma drafts kept in reserve for a rollback, and a drafter's catch-up pass of 2 (its
        # last unfed draft and the bonus token): the last pass of a round that stopped after one draft
        assert max(held) <= 24 - 1 + 3 + 2
    assert "oldest turn" in chat.out.getvalue()  # it went past the context too


def test_the_cli_takes_a_budget_and_refuses_a_bad_one(tmp_path):
    import json
    import subprocess
    import sys

    from cli_models import write_tiny_model
    from test_cli import ROOT, env

    write_tiny_model(tmp_path / "t", seed=0)
    write_tiny_model(tmp_path / "d", seed=1)

    def run(*args):
        argv = [sys.executable, "infer.py", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                "--dtype", "float32", "--no-chat", *args]
        return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)

    done = run("--kv-budget", "12", "--cache", "--json", "--length", "30", "--prompt", " ".join(["w1 w2 w3"] * 6))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "KV budget 12, streaming: 4 sinks + the 8 most recent positions" in done.stderr
    reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert reports["speculative"]["token_ids"] == reports["target"]["token_ids"] == reports["ngram"]["token_ids"]
    bad = run("--kv-budget", "5", "--prompt", "hello")
    assert bad.returncode == 2 and "--kv-budget: the KV budget must be at least 8" in bad.stderr
    assert "Traceback" not in bad.stderr


@torch.no_grad()
def test_a_bounded_cache_gives_the_cache_off_logits_at_every_step(target):
    """With evictions the cache holds fewer entries than positions: the runner passes the true position ids (a
    model would count them from what the cache holds, and the logits drift)."""
    seq = torch.tensor([LONG_PROMPT + [5 + (7 * i) % 40 for i in range(20)]], device=target.device)
    on, off = ModelRunner(target, use_cache=True), ModelRunner(target, use_cache=False)
    for n in range(len(LONG_PROMPT), seq.shape[1]):
        torch.testing.assert_close(on.logits(seq[:, :n], 1), off.logits(seq[:, :n], 1), rtol=1e-6, atol=1e-6)
    assert cache_length(on.cache) < on.cached  # it did evict


@torch.no_grad()
def test_a_turn_that_cuts_into_the_window_is_read_again(target):
    """A kept bounded cache cut back 2 positions would hold one key fewer than the next query's window: the runner
    starts over (keeps_window), and answers as a fresh one."""
    runner = ModelRunner(target, use_cache=True)
    first = autoregressive_run(LONG_PROMPT, target, 20, None, None, True, runner=runner).tokens
    held = LONG_PROMPT + first[:19]  # what the runner fed
    assert runner.cached == len(held)
    turn = held[:-2] + [(held[-2] + 1) % 50 + 5, 7]
    assert runner.reuse(turn) == 0
    seq = torch.tensor([turn], device=target.device)
    torch.testing.assert_close(runner.logits(seq, 1), ModelRunner(target, use_cache=True).logits(seq, 1),
                               rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_a_bounded_cache_is_not_recovered_after_a_failed_pass(target):
    """A pass that failed after every layer wrote (an error in the head) leaves entries no count knows; after an
    eviction, cutting the cache back by its length less the count would keep some of them: not recovered."""
    seq = torch.tensor([LONG_PROMPT + [5 + (7 * i) % 40 for i in range(20)]], device=target.device)
    runner = ModelRunner(target, use_cache=True)
    runner.logits(seq[:, :11], 1)

    def fail(module, args, kwargs):
        raise RuntimeError("out of memory")

    hook = target.lm_head.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            runner.logits(seq[:, :20], 1)
    finally:
        hook.remove()
    assert not runner.recover()
