"""What holds for every KV policy that chooses what a cache keeps from attention weights (`snapkv`, `h2o`):
greedy SD and NASD equal AR under the same policy and budget, with wide verification passes, drafts fed beside
the prompt, chunked prefills, chat turns and the native mode; the cache stays bounded; the CLI runs them."""

import copy
import io

import pytest
import torch

from conftest import PROMPT, tiny_decoder
from ngram_assisted import NGramStorage, ngram_assisted_speculative_generate
from sampling import LoopSettings, autoregressive_generate, speculative_run
from utils import h2o
from utils.caching import CACHE_POLICIES, cache_length
from utils.logits_processor import GreedyProcessor
from utils.model_runner import ModelRunner
from utils.models.rowwise_attention import use_kv_budget

BUDGET = 16  # against a 36-token prompt
LONG = PROMPT * 3
UNSETTLED = {"snapkv": 0, "h2o": h2o.SETTLE_EVERY}  # rows a cache may hold past its budget between evictions


def budgeted(seed: int, policy: str, arch: str = "llama", budget: int = BUDGET, **kwargs):
    model = tiny_decoder(arch, seed=seed, init=0.3, **kwargs)
    use_kv_budget(model, budget, policy=policy)
    return model


@pytest.mark.parametrize("policy", CACHE_POLICIES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_sd_and_nasd_equal_ar(policy, arch, gamma):
    target, drafter = budgeted(0, policy, arch), budgeted(1, policy, arch)
    reference = autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)
    settings = LoopSettings(max_gen_len=30, gamma=gamma, eos_tokens_id=None)
    sd = speculative_run(LONG, drafter, target, GreedyProcessor(), settings, use_cache=True)
    assert sd.tokens == reference and sd.drafted
    nasd, _ = ngram_assisted_speculative_generate(LONG, NGramStorage(3, 64), target, gamma=gamma, max_gen_len=30,
                                                  eos_tokens_id=None, use_cache=True)
    assert nasd == reference
    # The target as its own drafter (whose prompt pass ends one token later, so it may keep other positions):
    # accepted runs, so wide verification passes; a drafter whose rollbacks lost its state would accept less.
    own = speculative_run(LONG, copy.deepcopy(target), target, GreedyProcessor(), settings, use_cache=True)
    assert own.tokens == reference and own.accepted >= 10


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_drafts_fed_with_the_prompt(policy):
    target = budgeted(0, policy)
    reference = autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)
    settings = LoopSettings(max_gen_len=30, gamma=4, eos_tokens_id=None, first_target=False)
    result = speculative_run(LONG, copy.deepcopy(target), target, GreedyProcessor(), settings, use_cache=True)
    assert result.tokens == reference


def budgeted_chat(folder, policy: str, **settings):
    """A chat session on a tiny model (drafting for a copy of itself) under the policy and a budget of 40, the
    cache on and prompts read in passes of 8."""
    from cli_models import write_tiny_model
    from utils.chat.session import Session
    from utils.chat.settings import Settings
    from utils.models.model_loader import load_model

    write_tiny_model(folder, context=400)
    model, tokenizer = load_model(str(folder), device="cpu", dtype="float32", progress=False)
    drafter = copy.deepcopy(model)
    for m in (model, drafter):
        use_kv_budget(m, 40, policy=policy)
    chat = Session(model, drafter, tokenizer, Settings(use_cache=True, prefill_chunk=8, **settings))
    chat.out = io.StringIO()
    return chat


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_chunked_prefill_and_chat_turns(tmp_path, policy):
    from utils.chat.commands import CommandError

    chat = budgeted_chat(tmp_path / "m", policy, length=12, gamma=3)
    for i in range(5):
        reports = {r.generator: r for r in chat.answer(f"w{i} w{i * 3 % 7} hello world write code " * 3)}
        assert all(r.error is None for r in reports.values())
        assert reports["speculative"].token_ids == reports["target"].token_ids == reports["ngram"].token_ids
        assert max(cache_length(r.cache) for r in chat.kept["speculative"]) <= 40 + UNSETTLED[policy] + 3
    with pytest.raises(CommandError, match=f"the {policy} policy evicts from the KV cache: the cache stays on"):
        chat.toggle_cache()


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_each_turn_is_read_afresh_so_every_generator_answers_alike(tmp_path, policy):
    """A runner kept from an earlier turn answers the next as a fresh one does. Kept, its cache was chosen from
    the earlier turn's queries alone and cut back or not as its own passes fell, so SD and NASD drifted from the
    target a few turns into a conversation (found under h2o, budget 64, the embedded pair; snapkv too)."""
    from sampling import autoregressive_run

    target = budgeted(0, policy)
    kept = ModelRunner(target, use_cache=True)
    first = autoregressive_run(LONG, target, 20, eos_tokens_id=None, use_cache=True, runner=kept).tokens
    turn = LONG + first + PROMPT
    again = autoregressive_run(turn, target, 20, eos_tokens_id=None, use_cache=True, runner=kept).tokens
    assert again == autoregressive_run(turn, target, 20, eos_tokens_id=None, use_cache=True).tokens
    chat = budgeted_chat(tmp_path / "m", policy, length=16, gamma=5)
    for i in range(4):
        reports = {r.generator: r for r in chat.answer(f"w{i} w{i * 3 % 7} hello world write code " * 2)}
        assert reports["speculative"].token_ids == reports["target"].token_ids == reports["ngram"].token_ids, i


@pytest.fixture(scope="module")
def native_models():
    from test_drafter_window import native_pair

    return native_pair()


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_native_mode_chunked_prefill_equals_one_pass(native_models, policy):
    target, drafter = native_models
    for model in (target, drafter):
        use_kv_budget(model, BUDGET, policy=policy)  # each test sets its own policy on the shared pair
    seq = torch.tensor([LONG])
    whole = ModelRunner(target, use_cache=True)
    chunked = ModelRunner(target, use_cache=True, prefill_chunk=8)
    assert torch.equal(whole.logits(seq, 1), chunked.logits(seq, 1))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(whole.cache.layers, chunked.cache.layers))
    reference = autoregressive_generate(LONG, target, max_gen_len=20, eos_tokens_id=None, use_cache=True)
    settings = LoopSettings(max_gen_len=20, gamma=3, eos_tokens_id=None)
    runners = ModelRunner(target, use_cache=True, prefill_chunk=8), ModelRunner(drafter, use_cache=True, prefill_chunk=8)
    assert speculative_run(LONG, drafter, target, GreedyProcessor(), settings, runners=runners).tokens == reference


@pytest.mark.parametrize("policy", CACHE_POLICIES)
@torch.no_grad()
def test_an_interrupted_prompt_pass_is_read_again(native_models, policy):
    """Ctrl-C between the chunks of a prompt pass: the cache holds positions it has not cut to the budget yet,
    so the runner drops them; the next call reads the prompt again, as a fresh runner would."""
    from test_prefill_chunks import Bar

    target, _ = native_models
    use_kv_budget(target, BUDGET, policy=policy)
    seq, log = torch.tensor([LONG]), []
    runner = ModelRunner(target, use_cache=True, prefill_chunk=8, progress=lambda total: Bar(total, log, 2))
    with pytest.raises(KeyboardInterrupt):
        runner.logits(seq, 1)
    assert runner.cached == 0 and cache_length(runner.cache) == 0 and log[-1] == ("close",)
    runner.progress = None
    assert torch.equal(runner.logits(seq, 1), ModelRunner(target, use_cache=True).logits(seq, 1))
    assert cache_length(runner.cache) == BUDGET - 1


@pytest.mark.parametrize("policy, line", [
    ("snapkv", "KV budget 24, snapkv: the 18 most attended prompt positions + the 6 most recent"),
    ("h2o", "KV budget 24, h2o: 4 sinks + the 10 most attended so far (H2O) + the 10 most recent"),
])
def test_the_cli_runs_the_policy_with_a_windowed_drafter(tmp_path, policy, line):
    import json
    import subprocess
    import sys

    from cli_models import write_tiny_model
    from test_cli import ROOT, env

    write_tiny_model(tmp_path / "t", seed=0)
    write_tiny_model(tmp_path / "d", seed=1)
    argv = [sys.executable, "infer.py", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
            "--dtype", "float32", "--no-chat", "--kv-budget", "24", "--kv-policy", policy, "--cache",
            "--drafter-window", "12", "--json", "--length", "30", "--prompt", " ".join(["w1 w2 w3 hello"] * 12)]
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert line in done.stderr and "drafter window 12 (4 sinks + the 8 most recent positions)" in done.stderr
    reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert reports["speculative"]["token_ids"] == reports["target"]["token_ids"] == reports["ngram"]["token_ids"]
