"""`--kv-policy snapkv`: after a prompt is read with full attention, each layer and kv head keeps the prompt
positions its last queries attended to most; SD and NASD still equal AR under the same policy and budget."""

import copy
import io

import pytest
import torch

from conftest import PROMPT, tiny_decoder
from ngram_assisted import NGramStorage, ngram_assisted_speculative_generate
from sampling import LoopSettings, autoregressive_generate, autoregressive_run, speculative_run
from utils import snapkv
from utils.caching import cache_length
from utils.logits_processor import GreedyProcessor
from utils.model_runner import ModelRunner
from utils.models.rowwise_attention import use_kv_budget

BUDGET = 16  # 12 kept prompt positions + a recent window of 4, against a 36-token prompt
LONG = PROMPT * 3


def budgeted(seed: int, policy: str = "snapkv", arch: str = "llama"):
    model = tiny_decoder(arch, seed=seed, init=0.3)
    use_kv_budget(model, BUDGET, policy=policy)
    return model


@pytest.fixture(scope="module")
def target():
    return budgeted(0)


@pytest.fixture(scope="module")
def reference(target):
    return autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)


def test_kept_slots_are_the_most_attended_with_their_neighbours():
    scores = torch.zeros(2, 40)
    scores[0, 20], scores[1, 5], scores[1, 33] = 1.0, 1.0, 0.5
    kept = snapkv.kept_slots(scores, candidates=30, keep=7)  # slot 33 is not a candidate
    assert kept.shape == (2, 7) and torch.equal(kept, kept.sort(-1).values)
    assert kept[0].tolist() == list(range(17, 24))  # the peak and its pooled neighbours
    assert set(range(2, 9)) == set(kept[1].tolist())


def test_snapkv_keeps_other_positions_than_streaming(target, reference):
    full = autoregressive_generate(LONG, tiny_decoder("llama", seed=0, init=0.3), max_gen_len=30, eos_tokens_id=None)
    streaming = autoregressive_generate(LONG, budgeted(0, "streaming"), max_gen_len=30, eos_tokens_id=None)
    assert reference != full and reference != streaming  # the policy really decides (else the tests prove nothing)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_sd_and_nasd_equal_ar_under_snapkv(arch, gamma):
    target, drafter = budgeted(0, arch=arch), budgeted(1, arch=arch)
    reference = autoregressive_generate(LONG, target, max_gen_len=30, eos_tokens_id=None, use_cache=True)
    settings = LoopSettings(max_gen_len=30, gamma=gamma, eos_tokens_id=None)
    sd = speculative_run(LONG, drafter, target, GreedyProcessor(), settings, use_cache=True)
    assert sd.tokens == reference and sd.drafted
    nasd, _ = ngram_assisted_speculative_generate(LONG, NGramStorage(3, 64), target, gamma=gamma, max_gen_len=30,
                                                  eos_tokens_id=None, use_cache=True)
    assert nasd == reference
    # The target as its own drafter (whose prompt pass ends one token later, so it may keep other positions):
    # accepted runs, so wide verification passes.
    own = speculative_run(LONG, copy.deepcopy(target), target, GreedyProcessor(), settings, use_cache=True)
    assert own.tokens == reference and own.accepted > 0


def test_drafts_fed_with_the_prompt_are_not_observed(target, reference):
    settings = LoopSettings(max_gen_len=30, gamma=4, eos_tokens_id=None, first_target=False)
    result = speculative_run(LONG, copy.deepcopy(target), target, GreedyProcessor(), settings, use_cache=True)
    assert result.tokens == reference


def test_the_cache_is_compressed_after_the_prompt_and_stays_bounded(target):
    runner = ModelRunner(target, use_cache=True)
    runner.logits(torch.tensor([LONG]), 1)
    kept, window = snapkv.split_budget(BUDGET)
    assert cache_length(runner.cache) == kept + window - 1  # what the next query sees besides itself
    result = autoregressive_run(LONG, target, 40, None, None, True, runner=runner)
    assert len(result.tokens) == 40 and cache_length(runner.cache) <= BUDGET


def test_chunked_prefill_and_chat_turns_under_snapkv(tmp_path):
    from cli_models import write_tiny_model
    from utils.chat.commands import CommandError
    from utils.chat.session import Session
    from utils.chat.settings import Settings
    from utils.models.model_loader import load_model

    write_tiny_model(tmp_path / "m", context=400)
    model, tokenizer = load_model(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    drafter = copy.deepcopy(model)
    for m in (model, drafter):
        use_kv_budget(m, 40, policy="snapkv")
    chat = Session(model, drafter, tokenizer, Settings(length=12, use_cache=True, gamma=3, prefill_chunk=8))
    chat.out = io.StringIO()
    for i in range(5):
        reports = {r.generator: r for r in chat.answer(f"w{i} w{i * 3 % 7} hello world write code " * 3)}
        assert all(r.error is None for r in reports.values())
        assert reports["speculative"].token_ids == reports["target"].token_ids == reports["ngram"].token_ids
        assert max(cache_length(r.cache) for r in chat.kept["speculative"]) <= 40 + 3
    with pytest.raises(CommandError, match="the cache stays on"):
        chat.toggle_cache()


def test_native_mode_chunked_prefill_equals_one_pass():
    from test_drafter_window import native_pair

    target, drafter = native_pair()
    for model in (target, drafter):
        use_kv_budget(model, BUDGET, policy="snapkv")
    seq = torch.tensor([LONG])
    whole = ModelRunner(target, use_cache=True)
    chunked = ModelRunner(target, use_cache=True, prefill_chunk=8)
    assert torch.equal(whole.logits(seq, 1), chunked.logits(seq, 1))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(whole.cache.layers, chunked.cache.layers))
    reference = autoregressive_generate(LONG, target, max_gen_len=20, eos_tokens_id=None, use_cache=True)
    settings = LoopSettings(max_gen_len=20, gamma=3, eos_tokens_id=None)
    runners = ModelRunner(target, use_cache=True, prefill_chunk=8), ModelRunner(drafter, use_cache=True, prefill_chunk=8)
    assert speculative_run(LONG, drafter, target, GreedyProcessor(), settings, runners=runners).tokens == reference


def test_snapkv_without_the_cache_or_with_a_bad_name_is_refused(target):
    with pytest.raises(ValueError, match="turn the cache on"):
        ModelRunner(target, use_cache=False)
    with pytest.raises(ValueError, match="unknown KV policy 'lru'; use one of streaming, h2o, snapkv"):
        use_kv_budget(tiny_decoder("llama", seed=0), BUDGET, policy="lru")
    with pytest.raises(ValueError, match="larger than the model's context"):
        use_kv_budget(tiny_decoder("llama", seed=0), 10_000, policy="snapkv")


def test_the_cli_runs_snapkv_with_a_windowed_drafter(tmp_path):
    import json
    import subprocess
    import sys

    from cli_models import write_tiny_model
    from test_cli import ROOT, env

    write_tiny_model(tmp_path / "t", seed=0)
    write_tiny_model(tmp_path / "d", seed=1)
    argv = [sys.executable, "infer.py", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
            "--dtype", "float32", "--no-chat", "--kv-budget", "24", "--kv-policy", "snapkv", "--cache",
            "--drafter-window", "12", "--json", "--length", "30", "--prompt", " ".join(["w1 w2 w3 hello"] * 12)]
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "KV budget 24, snapkv: the 18 most attended prompt positions + the 6 most recent" in done.stderr
    assert "drafter window 12 (4 sinks + the 8 most recent positions)" in done.stderr
    reports = {r["generator"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert reports["speculative"]["token_ids"] == reports["target"]["token_ids"] == reports["ngram"]["token_ids"]
