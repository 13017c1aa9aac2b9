"""The replay of benchmarks/draft_replay.py: rounds on recorded verdicts, the oracle's bound, the learned rule on a
simulated clock."""

import itertools
import random

import pytest

from benchmarks.draft_replay import (Costs, Record, fixed, learned_seconds, oracle_plan, rate, refit_seconds,
                                     refit_threshold, replay, run_of_matches, threshold)
from sampling import draft_stop


def record(matches, top=None, accept=None):
    n = len(matches)
    return Record([bool(m) for m in matches], top or [0.9] * n, [0.5] * n, accept or [0.9] * n)


COSTS = Costs(draft=1.0, verify={w: 10.0 + w for w in range(1, 10)})


def test_a_round_keeps_the_run_of_matches_and_one_token_more():
    r = record([1, 1, 0, 1, 1, 1, 0, 0])
    # gamma 2 from 0: drafts 0,1 match -> 3 tokens (t=3); from 3: 3,4 match -> t=6; from 6: 6 misses -> t=7;
    # from 7: one position left, one draft, misses -> t=8. Rounds of 2, 2, 2, 1 drafts.
    seconds, tokens = replay(r, COSTS, fixed(2)(r))
    assert tokens == 8
    assert seconds == 3 * (2 * 1.0 + 13.0) + (1.0 + 12.0)
    assert run_of_matches(r.matches, 3, 8) == 3 and run_of_matches(r.matches, 3, 2) == 2


def brute_force(matches, costs, most):
    """Every schedule of drafts per round, tried."""
    def best(t):
        if t >= len(matches):
            return 0.0
        return min(costs.of_round(k) + best(t + run_of_matches(matches, t, k) + 1)
                   for k in range(0, min(most, len(matches) - t) + 1))
    return best(0)


@pytest.mark.parametrize("seed", range(20))
def test_the_oracle_is_the_best_schedule_and_bounds_every_fixed_length(seed):
    rng = random.Random(seed)
    matches = [rng.random() < 0.7 for _ in range(rng.randint(1, 9))]
    costs = Costs(draft=rng.uniform(0.1, 3), verify={w: 10 + rng.uniform(0.5, 2) * w for w in range(1, 6)},
                  round=rng.uniform(0, 1))
    r = record(matches)
    seconds, plan = oracle_plan(r, costs, 4)
    assert seconds == pytest.approx(brute_force(matches, costs, 4))
    assert sum(k + 1 for k in plan) >= len(matches)  # the plan covers the answer
    for gamma in range(1, 5):
        assert seconds <= replay(r, costs, fixed(gamma)(r))[0] + 1e-9


def test_the_oracle_drafts_only_what_is_kept():
    r = record([1, 1, 1, 0, 1])
    seconds, plan = oracle_plan(r, Costs(draft=0.1, verify={w: 10.0 for w in range(1, 9)}), 8)
    # flat passes: the three matches in one round (4 tokens), then the last position by a plain pass, since a
    # draft there would only add its step
    assert plan == [3, 0]
    assert seconds == pytest.approx(10.3 + 10)


def test_a_threshold_stops_after_the_first_low_draft():
    r = record([1] * 6, top=[0.9, 0.2, 0.9, 0.9, 0.9, 0.9])
    drafts_at = threshold("top", 0.5, 4)(r)
    assert drafts_at(0) == 2  # the low draft at position 1 is proposed, then the round stops
    assert drafts_at(2) == 4  # capped
    assert rate([r], COSTS, threshold("top", 0.5, 4)) > 0


def test_the_learned_rule_drafts_where_passes_are_flat_and_not_where_a_row_costs_a_pass():
    sure = record([1] * 40, accept=[0.99] * 40)
    flat = Costs(draft=0.5, verify={w: 10.0 for w in range(1, 10)})
    seconds, tokens, drafted, rounds = learned_seconds([sure], flat, 4)
    assert tokens == 40 and drafted / rounds > 3
    steep = Costs(draft=5.0, verify={w: 10.0 * w for w in range(1, 10)})  # an extra row costs a whole pass
    seconds, tokens, drafted, rounds = learned_seconds([record([1] * 40, accept=[0.6] * 40)], steep, 4)
    assert drafted / rounds < 0.5  # after its first measured rounds it stops drafting
    assert draft_stop.time.perf_counter is not None and draft_stop.time.__name__ == "time"  # the clock restored


def test_the_refitted_threshold_is_the_roc_point_of_least_cost():
    # kept drafts score 0.9, 0.8, 0.6; rejected ones 0.7, 0.3. Cost fpr + 3 fnr: at 0.6 every kept draft is above
    # (fnr 0) and one of two rejected ones (fpr 0.5): 0.5, the least; at 0.8 (fpr 0, fnr 1/3) 1.0; at inf 3.
    assert refit_threshold([0.9, 0.7, 0.8, 0.3, 0.6], [True, False, True, False, True]) == 0.6
    # a missed acceptance weighed like a drafted rejection: 0.8 (fnr 1/3, fpr 0) beats 0.6 (fpr 0.5)
    assert refit_threshold([0.9, 0.7, 0.8, 0.3, 0.6], [True, False, True, False, True], miss_weight=1.0) == 0.8
    # no kept draft above any rejected one: drafting nothing wins once misses weigh less than false drafts
    assert refit_threshold([0.2, 0.9], [True, False], miss_weight=0.5) == float("inf")


def test_the_refitted_rule_learns_to_stop_before_low_drafts():
    # drafts of top probability 0.95 are kept, those of 0.5 rejected: the threshold moves from 0.4 to between them,
    # so later rounds stop after a 0.5 draft instead of drafting past it
    rng = random.Random(1)
    sure = [rng.random() < 0.7 for _ in range(200)]
    r = record(sure, top=[0.95 if m else 0.5 for m in sure])
    seconds, tokens, drafted, rounds = refit_seconds([r], COSTS, 4)
    assert tokens == 200 and seconds == pytest.approx(sum(COSTS.of_round(k) for k in refit_rounds(r, 4)))
    assert rate([r], COSTS, lambda rec: (lambda t: 4)) < tokens / seconds  # better than drafting 4 past rejections


def test_the_refit_waits_for_more_than_5_verdicts_of_both_outcomes():
    # transformers fits only then: with every draft kept, fpr is 0/0 and the fit would stop all drafting; at 5
    # verdicts its first fit would have come one round early
    _, _, drafted, rounds = refit_seconds([record([True] * 20, top=[0.95] * 20)], COSTS, 4)
    assert (drafted, rounds) == (4 + 4 + 4 + 4, 4)
    # 4 kept at 0.95 and a rejection at 0.5 (5 verdicts), then only kept drafts at 0.6: fitted at 5, the threshold
    # would be 0.95 and the second round would stop after one draft
    r = record([True] * 4 + [False] + [True] * 10, top=[0.95] * 4 + [0.5] + [0.6] * 10)
    _, _, drafted, rounds = refit_seconds([r], COSTS, 5)
    assert (drafted, rounds) == (5 + 5 + 4, 3)


def refit_rounds(r, most):
    """The same rule written out the slow way: the threshold fitted anew from every verdict before each round."""
    below, scores, kept, t, rounds = 0.4, [], [], 0, []
    while t < len(r.matches):
        k = 1
        while k < min(most, len(r.matches) - t) and r.top[t + k - 1] >= below:
            k += 1
        n = run_of_matches(r.matches, t, k)
        scores += r.top[t:t + min(n + 1, k)]
        kept += [True] * n + [False] * (min(n + 1, k) - n)
        if len(scores) > 5 and True in kept and False in kept:
            below = min([float("inf")] + sorted(set(scores), reverse=True), key=lambda c: (
                sum(s >= c and not y for s, y in zip(scores, kept)) / kept.count(False)
                + 3 * (1 - sum(s >= c and y for s, y in zip(scores, kept)) / kept.count(True))))
        rounds.append(k)
        t += n + 1
    return rounds


def test_every_fixed_schedule_replays_a_full_answer():
    for matches in itertools.product([0, 1], repeat=5):
        r = record(matches)
        for gamma in (1, 3):
            assert replay(r, COSTS, fixed(gamma)(r))[1] == 5


def test_the_table_row_has_a_cell_per_length_and_rule_and_the_oracle_on_top():
    from benchmarks.draft_replay import chosen_rules, group_row

    rng = random.Random(0)
    records = [record([rng.random() < 0.8 for _ in range(60)], top=[rng.random() for _ in range(60)],
                      accept=[rng.uniform(0.5, 1) for _ in range(60)]) for _ in range(3)]
    rules, chosen = chosen_rules({"g": records}, COSTS, 4)
    assert list(rules) == ["confidence", "entropy", "SpecDec++ (head)"] and len(chosen) == 3
    row = group_row("chat", records, COSTS, rules, 4)
    cells = row.strip("|").split("|")
    assert len(cells) == 3 + 4 + 3 + 1 + 1 + 1 + 1 + 1  # group, matches, AR; g1..g4; rules; learned; refit; per answer;
    best_fixed = max(rate(records, COSTS, fixed(g)) for g in range(1, 5))  # oracle; gains
    tokens = sum(len(r.matches) for r in records)
    oracle = tokens / sum(oracle_plan(r, COSTS, 4)[0] for r in records)
    per_answer = tokens / sum(min(replay(r, COSTS, fixed(g)(r))[0] for g in range(1, 5)) for r in records)
    assert f"oracle {oracle / best_fixed - 1:+.1%}" in row and oracle >= per_answer >= best_fixed
    assert f"per answer {per_answer / best_fixed - 1:+.1%}" in row
    # the learned rule at the same cap as every other rule, and the oracle's drafts a round (not an answer)
    seconds, _, drafted, rounds = learned_seconds(records, COSTS, 4)
    assert cells[10].split()[0] == f"{tokens / seconds:.2f}" and cells[10].strip().endswith(f"({drafted / rounds:.1f})")
    plans = [oracle_plan(r, COSTS, 4)[1] for r in records]
    assert cells[-2].strip().endswith(f"({sum(map(sum, plans)) / sum(map(len, plans)):.1f})")
    # the row names the fastest of the rules (the swept ones, learned, refit) beside its gain
    names = [*rules, "learned", "refit"]
    rule_rates = [float(cell.split()[0]) for cell in cells[7:7 + len(names)]]
    best_rule = cells[-1].split(" +")[0].split(" -")[0].strip()
    assert rule_rates[names.index(best_rule)] == max(rule_rates) > min(rule_rates)


def test_ar_pays_the_rounds_work_too():
    """AR runs through the same loop: with --round-ms, its rate left the round's work out and every "x AR" read
    low; an answer with nothing to replay gets the one-line error, not a ZeroDivisionError."""
    from benchmarks.draft_replay import group_row

    costs = Costs(draft=1.0, verify={w: 10.0 + w for w in range(1, 10)}, round=4.0)
    records = [record([True, False, True, True, False, True])]
    assert "| chat | 67% | 0.07 | " in group_row("chat", records, costs, {}, 2)  # 1 / (4 + 11); was 1 / 11 = 0.09
    with pytest.raises(ValueError, match="no answer positions to replay"):
        group_row("chat", [record([])], costs, {}, 2)


def test_bad_counts_are_refused_in_one_line(capsys):
    from benchmarks.draft_replay import parse_args

    assert parse_args([]).max_drafts == 8
    assert parse_args(["--round-ms", "0"]).round_ms == [0.0]  # no per-round work is a cost model, not an error
    for argv, message in ((["--max-drafts", "0"], "argument --max-drafts: expected an integer >= 1, got '0'"),
                          (["--turns", "0"], "argument --turns: expected an integer >= 1, got '0'"),
                          (["--round-ms", "-1"], "--round-ms must be a finite number of ms, at least 0")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_specdecs_stop_multiplies_the_rounds_predicted_acceptances():
    """SpecDec++ stops on the chance that *some* draft of the round is rejected (1 - the product of the predicted
    acceptances), not on one draft's own prediction: four drafts at 0.9 each carry a risk of 0.34, each alone 0.1.
    A risk reached exactly is not yet passed."""
    from benchmarks.draft_replay import cumulative

    r = record([1] * 7, accept=[0.9, 0.9, 0.9, 0.9, 0.9, 0.5, 0.9])
    drafts_at = cumulative("accept", 0.2, 8)(r)
    assert drafts_at(0) == 3  # risks 0.1, 0.19, then 0.271 > 0.2: the third draft is proposed, the round stops
    assert drafts_at(4) == 2  # 0.1, then 1 - 0.9 * 0.5 = 0.55
    assert drafts_at(6) == 1  # the answer's last position: one draft, nothing after it to read
    assert cumulative("accept", 0.5, 8)(record([1] * 4, accept=[0.5] * 4))(0) == 2  # 0.5 <= 0.5 goes on, 0.75 stops


def test_a_score_at_the_threshold_keeps_the_round_going():
    # the rule stops after a draft whose score is *below* the threshold, as `--draft-stop confidence` reads it
    r = record([1] * 4, top=[0.5, 0.5, 0.1, 0.9])
    assert threshold("top", 0.5, 4)(r)(0) == 3


def test_the_refit_keeps_the_highest_threshold_of_least_cost():
    # cost fpr + 2 fnr: 0.8 (fnr 1/2) and 0.3 (fpr 1) tie at 1.0; roc_curve lists thresholds highest first and
    # transformers takes the first least cost, so the replay must keep 0.8, the stricter rule
    assert refit_threshold([0.8, 0.5, 0.3], [True, False, True], miss_weight=2.0) == 0.8


def test_records_read_the_features_as_the_chat_predicts_from_them():
    """The replay rebuilds each position's scores from the trainer's feature rows: the entropy bound from the
    entropy column (1 - sqrt(H)) and the head's acceptance as `AcceptanceHead.predict` gives it in the chat."""
    import math

    import torch

    from benchmarks.draft_replay import records_of
    from sampling.acceptance_head import AcceptanceHead, features

    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    hidden = torch.randn(2, 3)
    torch.manual_seed(0)
    head = AcceptanceHead(3, width=4).eval()
    with torch.no_grad():
        head.mlp[2].bias.fill_(3.0)  # logits far from 0..1, so a missing sigmoid shows
    [r] = records_of([(features(hidden, probs), torch.tensor([1.0, 0.0]), probs.max(-1).values)], head)
    assert r.matches == [True, False] and r.top == pytest.approx([0.7, 0.25])
    h0 = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert r.bound == pytest.approx([1 - math.sqrt(h0), 1 - math.sqrt(math.log(4))], abs=1e-6)
    assert r.accept == pytest.approx([head.predict(hidden[i:i + 1], probs[i:i + 1]) for i in range(2)], abs=1e-6)


def test_each_swept_rule_is_applied_at_its_best_value_on_the_training_prompts():
    from benchmarks.draft_replay import CONFIDENCES, ENTROPY_BOUNDS, RISKS, chosen_rules, cumulative

    rng = random.Random(3)
    records = []
    for _ in range(3):
        matches = [rng.random() < 0.7 for _ in range(50)]
        records.append(record(matches, top=[rng.uniform(0.6, 1) if m else rng.uniform(0, 0.7) for m in matches],
                              accept=[rng.uniform(0.7, 1) if m else rng.uniform(0.2, 0.8) for m in matches]))
    for r in records:
        r.bound = [2 * p - 1 for p in r.top]
    rules, chosen = chosen_rules({"g": records}, COSTS, 4)
    for name, family, scores, values in (("confidence", threshold, "top", CONFIDENCES),
                                         ("entropy", threshold, "bound", ENTROPY_BOUNDS),
                                         ("SpecDec++ (head)", cumulative, "accept", RISKS)):
        rates = [rate(records, COSTS, family(scores, v, 4)) for v in values]
        assert rate(records, COSTS, rules[name]) == max(rates) > min(rates)  # the sweep has a best to find


def test_the_learned_rule_pays_each_rounds_work_on_its_clock():
    # with --round-ms the learned rule's seconds include every round's own work, as every other rule's do
    flat = Costs(draft=0.5, verify={w: 10.0 for w in range(1, 10)}, round=4.0)
    seconds, tokens, drafted, rounds = learned_seconds([record([1, 1, 0] * 10, accept=[0.9] * 30)], flat, 4)
    assert seconds == pytest.approx(rounds * (4.0 + 10.0) + drafted * 0.5)


def test_the_records_are_collected_at_the_asked_answer_length(monkeypatch):
    # --train-tokens and --max-new-tokens give the records' answer lengths: each must reach the collector's key
    import torch

    from benchmarks import draft_replay
    from benchmarks.draft_replay import group_records

    seen = []

    def collect(args, prompts):
        seen.append(args.max_new_tokens)
        return {"chat": [(torch.zeros(2, 7), torch.ones(2), torch.ones(2))]}

    monkeypatch.setattr(draft_replay.data_source, "collect", collect)
    assert list(group_records("p.json", 40, lambda x: torch.zeros(len(x)))) == ["chat"]
    assert seen == [40]


def test_the_learned_rule_reads_the_prediction_of_the_draft_just_made():
    # the head judges the draft it was just shown: a draft predicted rejected is still proposed, then the round
    # stops. Here position 5 is predicted (and is) rejected: the first round drafts 0..5, the second the rest.
    r = record([1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1], accept=[0.99] * 5 + [0.0] + [0.99] * 6)
    flat = Costs(draft=0.5, verify={w: 10.0 for w in range(1, 10)})
    seconds, tokens, drafted, rounds = learned_seconds([r], flat, 8)
    assert (tokens, drafted, rounds) == (12, 12, 2)


def test_the_learned_rule_stops_drafting_once_first_drafts_keep_failing():
    # the round's verdict (how many drafts were kept) must reach the rule: its running acceptance of first drafts
    # is what tells it that drafting no longer pays, whatever the head predicts
    r = record([0] * 200, accept=[0.9] * 200)
    seconds, tokens, drafted, rounds = learned_seconds([r], Costs(draft=1.0, verify={w: 10.0 for w in range(1, 10)}), 4)
    assert rounds == 200 and drafted < 200
