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
    for argv, message in ((["--max-drafts", "0"], "argument --max-drafts: expected an integer >= 1, got '0'"),
                          (["--turns", "0"], "argument --turns: expected an integer >= 1, got '0'"),
                          (["--round-ms", "-1"], "--round-ms must be a finite number of ms, at least 0")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
