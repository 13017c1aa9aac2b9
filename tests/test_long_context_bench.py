"""`python -m benchmarks.long_context`: its needle prompts, its policy switching and its rows, on a tiny model
(the real runs' figures are in benchmarks/RESULTS.md)."""

from argparse import Namespace
from types import SimpleNamespace

from benchmarks import long_context
from utils.caching import kv_budget, kv_policy


def tiny(tmp_path):
    """A byte-level tokenizer (source code round-trips, newlines included) with a chat template, and a tiny
    model that reads its ids."""
    from cli_models import CHAT_TEMPLATE
    from conftest import tiny_decoder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"<eos>": len(alphabet)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tiny_decoder("llama", seed=0, vocab=len(vocab), context=2048), tokenizer


def test_needle_prompts_bury_the_needle_at_their_depth(tmp_path):
    _, tokenizer = tiny(tmp_path)
    top, bottom = (tokenizer.decode(long_context.needle_prompt(tokenizer, 400, depth, 48213)) for depth in (0.1, 0.9))
    needle = long_context.NEEDLE.format(value=48213)
    assert needle in top and needle in bottom
    assert top.index(needle) < len(top) // 3 and bottom.index(needle) > len(bottom) // 2
    assert long_context.QUESTION in top


def test_policies_are_switched_and_every_run_is_a_row(tmp_path):
    model, tokenizer = tiny(tmp_path)
    long_context.set_policy([model], "snapkv", 64)
    assert kv_policy(model) == "snapkv" and kv_budget(model) == (48, 16)
    long_context.set_policy([model], None)
    assert kv_budget(model) is None and kv_policy(model) == "streaming"
    args = Namespace(lengths=[300], depths=[0.5], shares=[0.25], policies=["streaming", "snapkv"], answer=4)
    rows = long_context.needle_runs(model, tokenizer, args)
    assert [r["policy"] for r in rows] == ["full", "streaming", "snapkv"] and kv_budget(model) is None
    full, streaming, snap = rows
    assert full["agreement"] == 4 and all(0 <= r["agreement"] <= 4 for r in rows)  # answers of 4 tokens, no end
    assert streaming["budget"] == snap["budget"] == int(full["prompt_tokens"] * 0.25)
    # streaming evicts between the prompt's chunks; SnapKV must read the whole prompt before it chooses
    assert streaming["peak_kv_mib"] < snap["peak_kv_mib"] <= full["peak_kv_mib"]
    long_context.plot(rows, tmp_path / "retrieval.png")
    assert (tmp_path / "retrieval.png").stat().st_size > 1000


def test_window_runs_take_turns_from_one_length_to_the_next(tmp_path, monkeypatch):
    """Target AR always ran first at each new length (it paid what a new length costs first), the windows last:
    the order now alternates over lengths; the rows keep the table's order and each SD run equals AR."""
    model, tokenizer = tiny(tmp_path)
    order = []
    for name in ("autoregressive_run", "speculative_run"):
        real = getattr(long_context, name)
        monkeypatch.setattr(long_context, name, lambda *a, _real=real, **k: order.append(k.get("drafter_window"))
                            or _real(*a, **k))
    args = Namespace(window_lengths=[300, 400], windows=[16, 16], window_answer=4, gamma=2)  # a window given twice
    rows = long_context.window_runs(model, model, tokenizer, args)
    assert order == [None, 0, 16, 16, 0, None]
    assert [r["method"] for r in rows] == ["target AR", "SD full drafter", "SD window 16"] * 2
    assert all(r["equal_to_ar"] for r in rows)


class Clock:
    """A perf_counter that moves only when told: the figures of a run with known durations."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_an_answers_first_token_time_and_decoding_rate_split_at_the_first_token(monkeypatch):
    """First-token time is the prompt's read up to the first token; the decoding rate counts the tokens after it
    over the time after it. Counting the first token (or the prompt's time) in the rate would credit a long
    prompt's policy with decoding it did not do."""
    clock = Clock()

    def run(ids, model, length, processor, stop, use_cache, on_round, runner):
        clock.now += 10.0  # the prompt's pass, ending with the first token
        on_round(1)
        for _ in range(4):  # four more tokens, a second each
            clock.now += 1.0
            on_round(1)
        return SimpleNamespace(tokens=[1, 2, 3, 4, 5])

    monkeypatch.setattr(long_context, "time", clock)
    monkeypatch.setattr(long_context, "autoregressive_run", run)
    monkeypatch.setattr(long_context, "PeakRunner", lambda *a, **k: SimpleNamespace(peak=2**20))
    figures = long_context.answer("model", [7] * 100, 5, [0])
    assert figures == {"tokens": [1, 2, 3, 4, 5], "first_token_s": 10.0, "decode_tokens_per_s": 1.0,
                       "peak_kv_mib": 1.0}


def test_each_policys_answer_is_compared_with_full_attentions(monkeypatch):
    """`agreement` is how far a policy's answer follows full attention's on the same prompt: every policy is held
    against the first (full) answer of its prompt, not against itself or the previous policy's."""
    policy = [None]
    answers = {None: [48213, 1, 2, 3], "streaming": [48213, 1, 9, 9], "snapkv": [9, 9, 9, 9]}
    monkeypatch.setattr(long_context, "stop_tokens", lambda *a, **k: [0])
    monkeypatch.setattr(long_context, "needle_prompt", lambda tokenizer, tokens, depth, value: [7] * tokens)
    monkeypatch.setattr(long_context, "set_policy", lambda models, name, budget=0: policy.__setitem__(0, name))
    monkeypatch.setattr(long_context, "answer", lambda model, ids, length, stop: {
        "tokens": answers[policy[0]], "first_token_s": 1.0, "decode_tokens_per_s": 1.0, "peak_kv_mib": 1.0})
    tokenizer = SimpleNamespace(decode=lambda ids, **_: " ".join(map(str, ids)))
    args = Namespace(lengths=[400], depths=[0.5], shares=[0.5], policies=["streaming", "snapkv"], answer=4)
    rows = long_context.needle_runs("model", tokenizer, args)
    assert [(r["policy"], r["agreement"], r["retrieved"], r["budget"]) for r in rows] == [
        ("full", 4, True, 400), ("streaming", 2, True, 200), ("snapkv", 0, False, 200)]


def window_fakes(monkeypatch, clock, results):
    """window_runs' decoders replaced: target AR takes 5 s, each SD run 2 s; `results[window]` is what SD returns.
    Returns the gammas SD was run with."""
    gammas = []
    monkeypatch.setattr(long_context, "stop_tokens", lambda *a, **k: [0])
    monkeypatch.setattr(long_context, "needle_prompt", lambda tokenizer, tokens, depth, value, question: [7] * tokens)
    monkeypatch.setattr(long_context, "time", clock)

    def ar(*args):
        clock.now += 5.0
        return SimpleNamespace(tokens=[1, 2, 3])

    def sd(ids, drafter, target, processor, settings, use_cache, drafter_window):
        clock.now += 2.0
        gammas.append(settings.gamma)
        return results[drafter_window]

    monkeypatch.setattr(long_context, "autoregressive_run", ar)
    monkeypatch.setattr(long_context, "speculative_run", sd)
    return gammas


def test_window_rows_time_each_run_alone_and_say_when_it_differs_from_ar(monkeypatch):
    """Each row's seconds are its own run's (a clock started once per length would charge a run with the ones
    before it); its output is checked against target AR's, so a window that changes the answer shows; a run that
    drafted nothing has no acceptance (undefined, not 0%); and the runs draft at --gamma."""
    from sampling.loop import GenerationResult

    clock = Clock()
    gammas = window_fakes(monkeypatch, clock, {
        0: GenerationResult([1, 2, 3], drafted=4, accepted=2),
        16: GenerationResult([1, 2, 4], drafted=0, accepted=0)})
    args = Namespace(window_lengths=[300], windows=[16], window_answer=3, gamma=5)
    rows = long_context.window_runs("target", "drafter", None, args)
    assert [(r["method"], r["seconds"], r["equal_to_ar"], r.get("acceptance")) for r in rows] == [
        ("target AR", 5.0, True, None), ("SD full drafter", 2.0, True, 0.5), ("SD window 16", 2.0, False, None)]
    assert gammas == [5, 5]


def test_the_needle_test_runs_alone_on_the_drafter_by_default_and_results_are_kept_part_by_part(monkeypatch, tmp_path):
    """--window-lengths with no lengths skips the drafter window, and the other way round (only both empty is
    refused); the needle test runs on the cheaper drafter unless --needle-model target; results.json is written after
    the needle part (so a failing window part keeps it) and marked complete only at the end."""
    import json

    seen = []
    monkeypatch.setattr(long_context, "load_model", lambda name, **k: ("model " + name, None))
    monkeypatch.setattr(long_context, "needle_prompt", lambda *a, **k: [7] * 400)
    monkeypatch.setattr(long_context, "warm_up", lambda *a: None)
    monkeypatch.setattr(long_context, "plot", lambda rows, path: None)
    monkeypatch.setattr(long_context, "needle_runs", lambda model, tokenizer, args: seen.append(model) or [{"n": 1}])

    def window_runs(target, drafter, tokenizer, args):
        saved = json.loads((tmp_path / "results.json").read_text())
        seen.append((saved["complete"], "needles" in saved))
        return [{"w": 1}]

    monkeypatch.setattr(long_context, "window_runs", window_runs)
    base = ["--target", "T", "--drafter", "D", "--out", str(tmp_path)]
    long_context.main([*base, "--lengths", "400", "--window-lengths"])
    assert seen == ["model D"] and json.loads((tmp_path / "results.json").read_text())["complete"]
    seen.clear()
    long_context.main([*base, "--lengths", "400", "--needle-model", "target", "--window-lengths", "500"])
    assert seen == ["model T", (False, True)]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["complete"] and saved["needles"] == [{"n": 1}] and saved["drafter_window"] == [{"w": 1}]
    seen.clear()
    long_context.main([*base, "--lengths", "--window-lengths", "500"])
    assert seen == [(False, False)]


def test_needle_prompts_hold_whole_source_lines_only(tmp_path):
    """The prompt is cut at a token count, which falls mid-line: the cut line is dropped, so that the code the
    model reads is real code (a half line just before the question reads as a syntax error to answer about)."""
    _, tokenizer = tiny(tmp_path)
    source_lines = {line for p in long_context.SOURCES for line in p.read_text().split("\n")}
    for tokens in (300, 333, 401):
        text = tokenizer.decode(long_context.needle_prompt(tokenizer, tokens, 0.5, 48213))
        code = text.split("```python\n", 1)[1].split("\n```\n", 1)[0].split("\n")
        assert code and all(line in source_lines for line in code if line != long_context.NEEDLE.format(value=48213))
