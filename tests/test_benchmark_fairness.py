"""What makes `python -m benchmarks`' figures comparable: the CPU named beside a GPU, llama.cpp refused beside ours
on a GPU, the methods' order alternating over prompts when there is one repeat, a broken lossless claim failing
the run, llama.cpp's speculative methods held against llama-plain and their drafts counted, a rate that leaves
the prompt's pass out, transformers' generate() greedy, and the llama.cpp build named in the results."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks import llama_cpp_peer, run
from benchmarks.run import parse_args
from utils.chat.settings import parse_processor


def test_a_gpu_runs_figures_name_the_cpu_too(monkeypatch):
    """machine() said only "NVIDIA H100 ..." on CUDA: the loop, the tokenizer and llama.cpp run on the CPU."""
    from utils.models.kernel_choice import describe_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")
    line = run.machine()
    assert line.startswith("Fake GPU; CPU ") and describe_cpu() in line


def test_llama_cpp_is_not_compared_with_ours_on_a_gpu(monkeypatch, capsys):
    """llama.cpp's peers run with n_gpu_layers 0 (the CPU); beside ours on a GPU, "vs llama.cpp" held two devices."""
    monkeypatch.setattr(llama_cpp_peer, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args(["--methods", "ours-ar,llama-plain"])
    assert "run llama.cpp on the CPU, ours on cuda" in capsys.readouterr().err
    assert not set(parse_args([]).methods) & set(llama_cpp_peer.METHODS)  # defaulted: left out, with a line
    assert "left out: llama.cpp runs on the CPU" in capsys.readouterr().err
    assert parse_args(["--device", "cpu", "--methods", "ours-ar,llama-plain"]).methods == ["ours-ar", "llama-plain"]


def test_one_repeat_still_alternates_the_order_over_prompts():
    """With --repeats 1 (most runs of RESULTS.md), every prompt ran the methods in table order: ours-ar always first
    after the warm-ups, llama-sd always last. The order follows each prompt's place in the whole run, so that one
    prompt a group (--quick) alternates too."""
    calls = []

    def once(method, ids, cache, n, seed=0):
        calls.append((method, n))
        return [1, 2], 0.5, None, None

    bench = SimpleNamespace(args=SimpleNamespace(repeats=1), processor=parse_processor(["greedy"]), once=once)
    for turn, group in enumerate(("chat", "code-writing")):  # each group's first prompt: index 0
        run.Bench.prompt_runs(bench, group, 0, [7], True, 2, ["a", "b", "c"], SimpleNamespace(update=lambda: None), turn)
    timed = [method for method, n in calls if n == 2]
    assert timed == ["a", "b", "c", "c", "b", "a"]


def test_llama_cpp_speculative_methods_are_held_against_llama_plain():
    """llama-sd's tokens were never compared with anything: a drafter hook that changed the answer went unseen
    (RESULTS.md's runs show llama-sd answers of 112 tokens where llama-plain's had 95)."""
    answers = {"llama-plain": [([5, 6], None)], "llama-sd": [([5, 7], None)], "llama-lookup": [([5, 6], None)],
               "ours-ar": [([1, 2], None)]}
    same = {m: run.prompt_run(m, "chat", 0, True, 1.0, answers, greedy=True).same_as_ar for m in answers}
    assert same == {"llama-plain": None, "llama-sd": False, "llama-lookup": True, "ours-ar": None}
    rows = run.summarise([run.prompt_run(m, "chat", 0, True, 1.0, answers, greedy=True) for m in answers])
    assert {r["method"]: r["same_as_ar"] for r in rows} == {"llama-plain": "-", "llama-sd": "0/1",
                                                            "llama-lookup": "1/1", "ours-ar": "-"}


def bench_of_runs(monkeypatch, runs: list, translated=None) -> None:
    """`run.main` with a bench that loads nothing and returns `runs` (`translated`: its drafter's other tokenizer)."""

    class FakeBench:
        def __init__(self, args):
            self.drafter = self.full_drafter = self.target = None
            self.draft_vocab, self.stop_caps, self.llama, self.translated = "", {}, None, translated

        def run(self):
            return runs

    monkeypatch.setattr(run, "Bench", FakeBench)
    monkeypatch.setattr(run, "precision_summary", lambda model: "native")
    monkeypatch.setattr(run, "plot", lambda *_: None)


def test_a_greedy_method_that_differs_from_ar_fails_the_run(monkeypatch, tmp_path):
    """The lossless check only wrote "3/4" in a column and the run ended with status 0 (draft_stop_ab stops)."""
    runs = [run.Run("ours-ar", "chat", 0, True, 4, 10.0, 4, None),
            run.Run("ours-sd-g4", "chat", 0, True, 4, 20.0, 2, False, 6, 3, 2),
            run.Run("ours-nasd", "chat", 0, True, 4, 12.0, 3, True, 2, 1, 3),
            run.Run("llama-sd", "chat", 0, True, 4, 9.0, 3, False, 6, 1, 3)]  # llama.cpp's own kernels: reported
    assert run.lossless_failures(runs) == ["ours-sd-g4 on chat prompt 0, cache on"]

    bench_of_runs(monkeypatch, runs)
    with pytest.raises(SystemExit, match="greedy output differs from ours-ar: ours-sd-g4 on chat prompt 0"):
        run.main(["--methods", "ours-ar,ours-sd-g4,ours-nasd", "--gammas", "4", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists()  # written first, for a look at what differed


@pytest.mark.skipif(not llama_cpp_peer.available(), reason="llama-cpp-python is not installed")
def test_llama_sd_drafts_with_its_drafter_and_counts_what_it_keeps(tmp_path):
    """With real llama.cpp on a tiny GGUF file, its own drafter: llama-sd calls the drafter every round (else it is
    llama-plain under another name) and the table gets its drafts, kept drafts and target passes."""
    from gguf_models import ALL_Q4K, write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True, types=ALL_Q4K)
    peer = llama_cpp_peer.LlamaPeer(model, model, context=128, sd_drafts=2)  # not the default: the count is passed
    ids = [2, 3, 4, 5, 6]
    plain = peer.generate("llama-plain", ids, 30, stop=[1])
    assert peer.counts("llama-plain", plain) is None
    target = peer.models["llama-sd"]
    evals, real_eval = [], target.eval
    target.eval = lambda tokens: evals.append(len(tokens)) or real_eval(tokens)  # the target's passes, seen
    for _ in range(2):  # each generation counts from zero
        evals.clear()
        tokens = peer.generate("llama-sd", ids, 30, stop=[1])
        counts = peer.counts("llama-sd", tokens)
        rounds, proposed = counts.rounds - 1, target.draft_model.proposed  # the prompt's pass aside
        assert rounds >= 1 and proposed == 2 * rounds and counts.drafted <= proposed
        # what the target really ran: the prompt, then a pass a round of its last token and the round's drafts
        assert counts.target_calls == len(evals) and evals[0] == len(ids)
        assert sum(evals[1:]) == rounds + proposed
        assert counts.accepted > 0  # the drafter is the target itself: its drafts are kept
        assert len(tokens) == len(plain)
    lookup = peer.counts("llama-lookup", peer.generate("llama-lookup", ids, 30, stop=[1]))
    assert lookup is not None and lookup.rounds >= 2


def test_a_rate_after_the_first_token_holds_answers_of_other_lengths_alike():
    """tokens/s is generated tokens over the whole generation, the prompt's pass included: llama.cpp answering 51
    tokens where ours answered 69 (RESULTS.md, code-editing prompt 0 in most runs) spread the same prefill over
    fewer tokens. The rate after the first token leaves the prefill out of both."""
    timing = {"ours-ar": ([1] * 69, 2.5, (1.0, 1)), "llama-plain": ([2] * 51, 2.7, (1.2, 1)),
              "hf-generate": ([1] * 69, 3.0, None)}

    def once(method, ids, cache, n, seed=0):
        tokens, seconds, first = timing[method]
        return tokens, seconds, None, first

    bench = SimpleNamespace(args=SimpleNamespace(repeats=1), processor=parse_processor(["greedy"]), once=once)
    runs = run.Bench.prompt_runs(bench, "code-editing", 0, [7], True, 128, list(timing),
                                 SimpleNamespace(update=lambda: None))
    rows = {r["method"]: r for r in run.summarise(runs)}
    assert rows["ours-ar"]["speedup_vs_llama"] == pytest.approx((69 / 2.5) / (51 / 2.7))  # 1.46x end to end
    assert rows["ours-ar"]["decode_tokens_per_s"] == pytest.approx(68 / 1.5)
    assert rows["ours-ar"]["decode_vs_llama"] == pytest.approx((68 / 1.5) / (50 / 1.5))  # 1.36x decoding
    assert rows["hf-generate"]["decode_tokens_per_s"] is None  # no hook into generate(): not guessed
    meta = dict(machine="m", target="t", drafter="d", dtype="x", max_new_tokens=128, cache_off_tokens=32,
                prompts_per_group=1, repeats=1)
    assert "| 45.33 | 1.36x |" in run.markdown(list(rows.values()), meta)


def test_our_first_token_is_timed_where_the_prompts_pass_ends():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).eval()
    bench = SimpleNamespace(target=model, stop=[], processor=parse_processor(["greedy"]),
                            args=SimpleNamespace(gammas=[2]), llama=None, stop_rules={}, prior=None, translated=None)
    bench.timed = lambda fn, first=(): run.Bench.timed(bench, fn, first)
    bench.ours = lambda *args, **kwargs: run.Bench.ours(bench, *args, **kwargs)
    for method in ("ours-ar", "ours-nasd"):
        tokens, seconds, result, first = run.Bench.once(bench, method, [1, 2, 3], True, 6)
        assert len(tokens) == 6 and first[1] == 1 and 0 < first[0] < seconds  # first_target: one token


@pytest.mark.skipif(not llama_cpp_peer.available(), reason="llama-cpp-python is not installed")
def test_llama_cpp_says_when_its_first_token_comes(tmp_path):
    from gguf_models import ALL_Q4K, write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True, types=ALL_Q4K)
    peer = llama_cpp_peer.LlamaPeer(model, context=64)
    marks = []
    assert len(peer.generate("llama-plain", [2, 3, 4], 5, [1], on_first=lambda: marks.append(1))) >= 1
    assert marks == [1]


def test_a_drafter_of_another_vocabulary_drafts_translated_as_the_chats_does(capsys):
    """With a drafter of another tokenizer (SmolLM2 for the Qwen pair) the benchmark fed it the target's ids, which
    it read as other tokens: 0-21% accepted where the chat's translated drafts kept 51-53%. It now translates, and
    leaves out what cannot: rules that read the drafter's distribution, llama.cpp's SD (the target's ids)."""
    from test_translating_drafter import (PROMPT_TEXT, RELABELLED, TARGET_TOKENIZER, model_for, relabelled_copy,
                                          word_tokenizer)

    from sampling import autoregressive_generate

    target = model_for(TARGET_TOKENIZER, seed=0, init=0.3)
    bench = run.Bench.__new__(run.Bench)
    bench.args = parse_args(["--methods", "ours-ar,ours-sd-g3,ours-sd-adaptive", "--gammas", "3"])
    bench.args.methods = bench.args.methods + ["ours-sd-confident", "ours-sd-learned", "llama-sd"]  # not asked for
    bench.target, bench.tokenizer, bench.drafter = target, TARGET_TOKENIZER, relabelled_copy(target)
    bench.processor, bench.stop, bench.stop_caps, bench.stop_rules = parse_processor(["greedy"]), [], {}, {}
    drafter_tokenizer = word_tokenizer(RELABELLED)
    bench.translated = run.Bench.translation(bench, drafter_tokenizer)
    assert bench.translated is drafter_tokenizer
    assert bench.args.methods == ["ours-ar", "ours-sd-g3", "ours-sd-adaptive"]
    assert "ours-sd-confident left out: the drafter's vocabulary differs" in capsys.readouterr().err
    ids = TARGET_TOKENIZER(PROMPT_TEXT)["input_ids"]
    reference = autoregressive_generate(ids, target, max_gen_len=20, eos_tokens_id=None, use_cache=True)
    for method in ("ours-sd-g3", "ours-sd-adaptive"):
        result = run.Bench.ours(bench, method, ids, True, 20)
        assert result.tokens == reference and result.acceptance_rate >= 0.9  # the target's own drafts, relabelled
    bench.drafter = target  # one vocabulary: nothing translated, nothing left out
    assert run.Bench.translation(bench, TARGET_TOKENIZER) is None and len(bench.args.methods) == 3


def test_generate_is_greedy_whatever_the_models_repetition_penalty():
    """transformers applies a model's `generation_config.repetition_penalty` (1.1 in some hub configs) even with
    do_sample=False: hf-generate then decoded otherwise than ours-ar, and "vs generate()" compared two answers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sampling import autoregressive_generate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=16)).eval()
    model.generation_config.repetition_penalty = 100.0  # never the same token twice, were it applied
    bench = SimpleNamespace(target=model, stop=[15])
    ids = [1, 2, 3]
    ours = autoregressive_generate(ids, model, max_gen_len=12, eos_tokens_id=[15], use_cache=True)
    assert len(set(ours)) < len(ours)  # a tiny random model repeats itself: the penalty would show
    assert run.Bench.hf(bench, "hf-generate", ids, 12) == ours


def test_the_results_name_the_llama_cpp_build_and_say_when_it_is_left_out(monkeypatch, capsys):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="0.3.36"))
    peer = SimpleNamespace(threads=2, sd_drafts=5, models={"llama-plain": None, "llama-sd": None})
    line = llama_cpp_peer.LlamaPeer.describe(peer)
    assert line == "llama-cpp-python 0.3.36, 2 threads; llama-sd: 5 drafts a round by the draft_model hook"
    meta = dict(machine="m", target="t", drafter="d", dtype="x", max_new_tokens=128, cache_off_tokens=32,
                prompts_per_group=1, repeats=1, llama_cpp=line)
    assert run.markdown([], meta).splitlines()[0].endswith(f"; {line}.")
    monkeypatch.setattr(llama_cpp_peer, "unavailable", lambda: "llama-cpp-python is not installed")
    monkeypatch.setattr(llama_cpp_peer, "available", lambda: False)
    assert not set(parse_args([]).methods) & set(llama_cpp_peer.METHODS)
    assert "llama.cpp's methods left out: llama-cpp-python is not installed" in capsys.readouterr().err


def test_the_prefill_benchmark_alternates_who_goes_first(monkeypatch, capsys):
    """Ours always ran before llama.cpp in every round, so a drift within a round fell on one side alone."""
    import sys
    import types

    from benchmarks import prefill

    calls = []
    monkeypatch.setattr(prefill, "load_model", lambda *a, **k: (None, lambda text: {"input_ids": [1, 2, 3]}))
    monkeypatch.setattr(prefill, "gguf_file", lambda target: "t.gguf")
    monkeypatch.setattr(llama_cpp_peer, "available", lambda: True)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=lambda **_: None))
    monkeypatch.setattr(prefill, "ours", lambda model, ids: calls.append("ours") or 1.0)
    monkeypatch.setattr(prefill, "llama", lambda llm, ids: calls.append("llama.cpp") or 2.0)
    prefill.main(["--repeats", "3"])
    assert calls == ["ours", "llama.cpp", "llama.cpp", "ours"] * 2
    assert "llama.cpp: 2.00 s (1.5 tokens/s), 2.00x ours" in capsys.readouterr().out


def test_each_prompt_of_a_run_gets_its_place_as_its_turn(tmp_path):
    """Bench.run hands every prompt its place in the whole run (groups and cache settings alike), not its index in
    its group, which restarts at 0: with one prompt a group, every prompt ran the methods in table order."""
    import json

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"chat": ["a", "b"], "code-writing": ["c"]}))
    turns = []
    args = SimpleNamespace(prompts=str(prompts), groups=["chat", "code-writing"], prompts_per_group=1,
                           cache_off_prompts=1, max_new_tokens=4, cache_off_tokens=4, methods=["ours-ar"],
                           gammas=[3], repeats=1)
    bench = SimpleNamespace(args=args, encode=lambda text: [1], once=lambda *a, **k: None,
                            prompt_runs=lambda group, i, ids, cache, n, methods, bar, turn: turns.append(
                                (group, i, cache, turn)) or [])
    assert run.Bench.run(bench) == []
    assert turns == [("chat", 0, True, 0), ("code-writing", 0, True, 1), ("chat", 0, False, 2),
                     ("code-writing", 0, False, 3)]


def test_llama_cpp_drafts_are_counted_as_our_loop_counts_them():
    """llama.cpp's table row must read like ours: the prompt's pass and one pass a round on the target, each round
    keeping its accepted drafts and one token of its own. The real-llama.cpp test above is skipped where
    llama-cpp-python is not installed (CI), so the arithmetic is pinned here on a counted fake drafter."""
    draft = llama_cpp_peer.CountingDraft(lambda ids, **_: [9, 9])
    for _ in range(3):  # three verification rounds of two drafts each
        draft([1, 2])
    peer = SimpleNamespace(models={"llama-sd": SimpleNamespace(draft_model=draft),
                                   "llama-plain": SimpleNamespace(draft_model=None)})
    counts = llama_cpp_peer.LlamaPeer.counts(peer, "llama-sd", [4, 5, 6, 7, 8, 9, 10, 11])
    # 8 tokens = 1 from the prompt's pass + 3 rounds' own tokens + 4 accepted drafts
    assert (counts.drafted, counts.accepted, counts.target_calls, counts.rounds) == (6, 4, 4, 4)
    assert llama_cpp_peer.LlamaPeer.counts(peer, "llama-plain", [4, 5]) is None  # no drafts: no draft figures
    draft.start(2, 30)
    assert (draft.rounds, draft.drafted, draft.proposed) == (0, 0, 0)


def peer_of(draft):
    return SimpleNamespace(models={"llama-sd": SimpleNamespace(draft_model=draft)})


def test_llama_cpp_drafts_past_the_budget_count_as_our_loop_never_drafts_them():
    """llama-cpp-python's hook drafts its full count up to the last round; our loop drafts only into the slots
    the budget leaves besides the round's own token, so the drafts past it read as rejected and llama-sd's
    acceptance read about 2% low over 128 tokens."""
    draft = llama_cpp_peer.CountingDraft(lambda ids, **_: [9, 9, 9])
    draft.start(2, 6)
    for seen in (3, 6, 7):  # the prompt's 2 ids and 1, 4, 5 tokens so far: 4, 1 and no slot left for a draft
        draft(list(range(seen)))
    assert (draft.drafted, draft.proposed, draft.rounds) == (3 + 1 + 0, 9, 3)


@pytest.mark.parametrize("second_round, accepted", [
    ([7, 7, 7], 3),  # 7 kept, the end token 0 is the round's own: 2 + 1 kept
    ([7, 0, 7], 4),  # 7 and the end token 0 both kept drafts: 2 + 2
])
def test_llama_cpp_drafts_past_the_answers_end_count_as_our_loop_cuts_them(second_round, accepted):
    """Our loop cuts a round's drafts at the end token and counts neither them as drafted nor the cut ones as
    rejected; llama.cpp's rows must count the last round the same way (2 of its 3 drafts reach the end here)."""
    rounds = iter([[9, 9, 9], second_round])
    draft = llama_cpp_peer.CountingDraft(lambda ids, **_: next(rounds))
    draft.start(2, 30, stop=[0])
    draft([1, 2, 5])  # after the prompt's token 5: 9, 9 kept, then its own 8
    draft([1, 2, 5, 9, 9, 8])
    counts = llama_cpp_peer.LlamaPeer.counts(peer_of(draft), "llama-sd", [5, 9, 9, 8, 7, 0])
    assert (counts.drafted, counts.accepted, counts.target_calls) == (3 + 2, accepted, 3)
    # an answer cut by its length, not ended: every draft of the last round stands
    assert llama_cpp_peer.LlamaPeer.counts(peer_of(draft), "llama-sd", [5, 9, 9, 8, 7, 7]).drafted == 6


def test_llama_cpp_marks_its_first_token_once_as_it_comes(monkeypatch, tmp_path):
    """The rate after the first token starts its clock at `on_first`: called once, when the first token arrives
    (the prompt read), not before it nor again later. Pinned on a fake Llama, as CI has no llama-cpp-python."""
    from test_benchmark_args import fake_llama_cpp

    fake_llama_cpp(monkeypatch)
    peer = llama_cpp_peer.LlamaPeer(tmp_path / "t.gguf")
    llm = peer.models["llama-plain"]
    assert peer.generate("llama-plain", [1, 2], 3, [], on_first=lambda: llm.log.append("first")) == [5, 6, 7]
    assert llm.log == [5, "first", 6, 7]


def prefill_main(monkeypatch, argv, ours, llama, ids=(1, 2, 3)):
    """`prefill.main(argv)` without models: `ours` and `llama` give each call's seconds; the Llama built is kept."""
    import sys
    import types

    from benchmarks import prefill

    built = []
    monkeypatch.setattr(prefill, "load_model", lambda *a, **k: (None, lambda text: {"input_ids": list(ids)}))
    monkeypatch.setattr(prefill, "gguf_file", lambda target: "t.gguf")
    monkeypatch.setattr(llama_cpp_peer, "available", lambda: True)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=lambda **kw: built.append(kw)))
    monkeypatch.setattr(prefill, "ours", lambda model, ids: ours(ids))
    monkeypatch.setattr(prefill, "llama", lambda llm, ids: llama(ids))
    prefill.main(argv)
    return built


def test_the_prefill_benchmark_times_the_median_after_an_untimed_run(monkeypatch, capsys):
    """The first run of each pays one-time costs (allocations, first use of the kernels) and is left out; the
    figure is the median of the rest, and both sides read the same prompt, cut to --tokens."""
    seen = []
    ours_times, llama_times = iter([100.0, 1.0, 3.0, 2.0]), iter([100.0, 6.0, 4.0, 2.0])
    built = prefill_main(monkeypatch, ["--repeats", "3", "--tokens", "4"],
                         lambda ids: seen.append(ids) or next(ours_times),
                         lambda ids: seen.append(ids) or next(llama_times), ids=range(1, 11))
    out = capsys.readouterr().out
    assert "prompt of 4 tokens" in out and all(ids == [1, 2, 3, 4] for ids in seen)
    assert "ours: 2.00 s (2.0 tokens/s), 1.00x ours" in out
    assert "llama.cpp: 4.00 s (1.0 tokens/s), 2.00x ours" in out
    # llama.cpp reads the whole prompt in one batch, on all the threads ours use, as ours reads it in one pass
    (kwargs,) = built
    assert kwargs["n_batch"] >= 4 and kwargs["n_ctx"] > 4
    assert kwargs["n_threads"] == kwargs["n_threads_batch"] == torch.get_num_threads()


def test_the_prefill_benchmark_times_the_prompts_pass_alone(monkeypatch):
    """llama.cpp's timed span is its prompt's evaluation after a reset (no prefix kept from the previous run: ours
    starts from an empty cache each time), not the reset; ours keeps one position's logits, as llama.cpp computes
    only the last one's."""
    from benchmarks import prefill

    clock, log = [0.0], []

    class Llm:
        def reset(self):
            log.append("reset")
            clock[0] += 50.0

        def eval(self, ids):
            log.append(list(ids))
            clock[0] += 1.0

    monkeypatch.setattr(prefill, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert prefill.llama(Llm(), [1, 2, 3]) == 1.0 and log == ["reset", [1, 2, 3]]
    monkeypatch.setattr(prefill, "new_cache", lambda model: "empty cache")

    def model(**kwargs):
        log.append(kwargs)
        clock[0] += 2.0

    assert prefill.ours(model, [1, 2]) == 2.0
    assert log[-1]["input_ids"].tolist() == [[1, 2]] and log[-1]["past_key_values"] == "empty cache"
    assert log[-1]["use_cache"] is True and log[-1]["logits_to_keep"] == 1


def test_the_turns_benchmark_alternates_and_drops_only_one_sessions_cache(monkeypatch, tmp_path):
    """`python -m benchmarks.turns` compares a session that keeps its KV cache over a conversation with one that
    drops it before every turn: the two must differ in that alone (target only, cache on), take turns going first
    (else drift weighs on one side), and come after a throwaway answer that warms the prefill path. The table
    must report what each session did."""
    from benchmarks import turns

    log, made = [], []

    class Session:
        def __init__(self, target, drafter, tokenizer, settings):
            made.append(self)
            self.settings, self.kept, self.name = settings, {}, ("kept", "dropped", "throwaway")[len(made) - 1]
            log.append(("new", self.name))

        def warm_up(self):
            log.append(("warm", self.name))

        def encode(self, prompt):
            return prompt.split()

        def answer(self, prompt):
            had_cache = bool(self.kept)
            log.append((self.name, turns.FOLLOW_UPS.index(prompt), had_cache))
            self.kept["target"] = "cache"
            return (SimpleNamespace(first_token_s=1.0 if had_cache else 4.0, tokens_per_s=10.0, tokens_generated=7,
                                    token_ids=[1, 2] + [3] * had_cache),)

    monkeypatch.setattr(turns, "Session", Session)
    monkeypatch.setattr(turns, "load_model", lambda name: ("target", "tokenizer"))
    monkeypatch.setattr(turns, "precision_summary", lambda model: "native")
    monkeypatch.setattr(turns, "machine", lambda: "m")
    turns.main(["--turns", str(len(turns.FOLLOW_UPS)), "--out", str(tmp_path)])  # every follow-up: allowed
    assert log[:6] == [("new", "kept"), ("new", "dropped"), ("warm", "kept"), ("new", "throwaway"),
                       ("throwaway", 0, False), ("kept", 0, False)]
    runs = log[5:]
    assert runs[:4] == [("kept", 0, False), ("dropped", 0, False), ("dropped", 1, False), ("kept", 1, True)]
    assert [name for name, _, _ in runs] == ["kept", "dropped", "dropped", "kept"] * (len(turns.FOLLOW_UPS) // 2)
    assert [turn for _, turn, _ in runs] == [t for t in range(len(turns.FOLLOW_UPS)) for _ in range(2)]
    assert all(had is (name == "kept" and turn > 0) for name, turn, had in runs)  # only "dropped" starts empty
    # both sessions run the target alone, cache on
    for session in made[:2]:
        assert session.settings.use_cache and [g for g, on in session.settings.enabled.items() if on] == ["target"]
    text = (tmp_path / "turns.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows[0] == f"| 1 | {len(turns.FOLLOW_UPS[0].split())} | 4.00 | 4.00 | 10.0 | 10.0 | 7 | True |"
    assert rows[1] == f"| 2 | {len(turns.FOLLOW_UPS[1].split())} | 1.00 | 4.00 | 10.0 | 10.0 | 7 | False |"
    assert len(rows) == len(turns.FOLLOW_UPS)
    assert f"Turn {len(turns.FOLLOW_UPS)} / turn 1, cache kept: 0.25x (dropped: 1.00x)." in text


def test_transformers_assisted_methods_get_their_own_drafter_and_a_translated_ones_tokenizers(monkeypatch):
    """hf-assisted drafts with the drafter as loaded by default, hf-assisted-cheap with our CLI's cheap copy (the two
    tell loop from drafter); a drafter of another vocabulary goes to transformers' universal assisted decoding with
    both tokenizers, as ours translates: without them transformers would feed it the target's ids."""
    seen = {}

    class Target:
        device = torch.device("cpu")

        def generate(self, x, **kwargs):
            seen.update(kwargs)
            return torch.tensor([[*x[0].tolist(), 7]])

    monkeypatch.setattr(run, "transformers_form", lambda model: model)
    full, cheap, target_tokenizer, drafter_tokenizer = object(), object(), object(), object()
    bench = SimpleNamespace(target=Target(), stop=[1], full_drafter=full, drafter=cheap, tokenizer=target_tokenizer,
                            translated=None)
    for method, assistant in (("hf-assisted", full), ("hf-assisted-cheap", cheap)):
        seen.clear()
        assert run.Bench.hf(bench, method, [3, 4], 1) == [7]
        assert seen["assistant_model"] is assistant and "assistant_tokenizer" not in seen and "tokenizer" not in seen
    bench.translated = drafter_tokenizer
    for method, assistant in (("hf-assisted", full), ("hf-assisted-cheap", cheap)):
        seen.clear()
        run.Bench.hf(bench, method, [3, 4], 1)
        assert seen["assistant_model"] is assistant
        assert seen["tokenizer"] is target_tokenizer and seen["assistant_tokenizer"] is drafter_tokenizer


def test_the_results_say_when_the_drafts_are_translated(monkeypatch, tmp_path):
    """A reader of results.json/.md must see that the drafter drafts in another vocabulary (its acceptance and speed
    are those of translated drafts), and a run with one vocabulary must not say so."""
    import json

    runs = [run.Run("ours-ar", "chat", 0, True, 4, 10.0, 4, None)]

    for translated, said in ((None, False), ("a tokenizer", True)):
        bench_of_runs(monkeypatch, runs, translated)
        out = tmp_path / str(said)
        run.main(["--methods", "ours-ar", "--gammas", "4", "--out", str(out)])
        drafter = json.loads((out / "results.json").read_text())["meta"]["drafter"]
        assert ("another vocabulary: drafts translated through text" in drafter) is said, drafter
        assert ("another vocabulary" in (out / "results.md").read_text()) is said


def test_the_bench_loads_a_drafter_of_another_vocabulary_as_translated(tmp_path):
    """Loaded from folders as `python -m benchmarks --target … --drafter …` does: the drafter's own tokenizer is the
    one its drafts are translated through (the target's would read its ids as other tokens)."""
    from test_translating_drafter import RELABELLED, TARGET_TOKENIZER, model_for, relabelled_copy, word_tokenizer

    target = model_for(TARGET_TOKENIZER, seed=0, init=0.3)
    target.save_pretrained(tmp_path / "target")
    TARGET_TOKENIZER.save_pretrained(tmp_path / "target")
    relabelled_copy(target).save_pretrained(tmp_path / "drafter")
    word_tokenizer(RELABELLED).save_pretrained(tmp_path / "drafter")
    for cheap in ([], ["--no-cheap-drafter"]):
        bench = run.Bench(parse_args(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                                      "--methods", "ours-ar,ours-sd-g3", "--gammas", "3", "--dtype", "float32",
                                      "--device", "cpu", *cheap]))
        assert bench.translated is not None and bench.translated.get_vocab() == RELABELLED
