"""`python -m benchmarks.draft_replay`: how much any draft-length rule could gain on this machine (issue 23), by
replaying greedy speculative decoding's rounds on recorded verdicts instead of running them.

Why a replay decides it: greedy verification accepts a draft exactly when it equals the target's token, and on the
accepted path the drafter's greedy draft at each position depends only on the prefix, which is AR's answer. So one
record per prompt (`train_acceptance_head`'s data: at each answer position, whether the drafter's greedy token
equals the target's, with the features the rules read) fixes every round of every rule: a round of k drafts from
position t accepts the run of matches from t, at most k, and yields that many tokens plus one. What a round costs
is measured here, on this CPU: a drafter step and a verification pass of each width (cache on, 200 positions held,
in turns, medians). A round of k drafts costs `--round-ms` + k drafter steps + a (k + 1)-row pass; the answers'
first tokens (the prefill's) are left out of every rule's time alike.

Replayed, per group of prompts:
- fixed gamma 1..`--max-drafts`;
- confidence P and entropy B (a round stops after a draft whose top probability, or AdaEDL's bound, is below the
  threshold), each threshold swept on the training prompts and the best applied to the held-out ones;
- SpecDec++'s own stop: a round stops once 1 - the product of the head's predicted acceptances (the chance that
  some draft so far is rejected) passes a risk, swept on the training prompts;
- learned: the shipped head's predictions, fed to `LearnedStop` itself on a simulated clock, so it measures the
  replayed costs as it does in a real run;
- refit: transformers' default assisted generation stop, a confidence threshold (from 0.4) fitted again after every
  round to all verdicts so far (`refit_threshold`), one rule kept across a group's answers;
- per answer: each answer at its own best fixed length, the ceiling of any rule that settles on one length per
  answer (from its acceptance so far, say);
- the oracle: the fewest seconds any rule can take when it knows every verdict in advance (dynamic programming
  over positions: from each position, the best number of drafts within the run of matches). It bounds every rule
  that only chooses how many drafts to propose: if it is not 10% above the best fixed length, no rule is.

    python -m benchmarks.draft_replay                    # the embedded pair; data from the cache folder or collected
    python -m benchmarks.draft_replay --round-ms 0 --round-ms 4   # the costs' per-round overhead, two ways
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks import train_acceptance_head as data_source
from sampling import draft_stop
from benchmarks.cli import at_least, guarded, tool_parser

CONFIDENCES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
ENTROPY_BOUNDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
RISKS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # SpecDec++'s: the chance of a rejection in a round
# transformers' re-fitted threshold: its start (`assistant_confidence_threshold`'s default), and the weight of a
# missed acceptance against a drafted rejection in the cost it minimises (fpr + 3 fnr)
REFIT_START, REFIT_MISS_WEIGHT = 0.4, 3.0


@dataclass
class Costs:
    """Seconds of a drafter step, of a verification pass by width (1 = plain decoding), and of a round's own work."""
    draft: float
    verify: dict[int, float]
    round: float = 0.0

    def of_round(self, drafts: int) -> float:
        return self.round + drafts * self.draft + self.verify[drafts + 1]


@dataclass
class Record:
    """One answer: `matches[i]` whether the drafter's greedy token at answer position i equals the target's,
    `top[i]` its top probability, `bound[i]` AdaEDL's 1 - sqrt(H), `accept[i]` the head's predicted acceptance."""
    matches: list[bool]
    top: list[float]
    bound: list[float]
    accept: list[float]


def run_of_matches(matches: list[bool], t: int, most: int) -> int:
    """Leading matches from position t, at most `most`: the drafts a round from t keeps."""
    n = 0
    while n < most and t + n < len(matches) and matches[t + n]:
        n += 1
    return n


def replay(record: Record, costs: Costs, drafts_at) -> tuple[float, int]:
    """Seconds and tokens of an answer's rounds after its first token; drafts_at(t): the drafts of the round from
    position t."""
    t, seconds = 0, 0.0
    while t < len(record.matches):
        k = min(drafts_at(t), len(record.matches) - t)
        seconds += costs.of_round(k)
        t += run_of_matches(record.matches, t, k) + 1
    return seconds, len(record.matches)


def fixed(gamma: int):
    return lambda record: (lambda t: gamma)


def threshold(scores: str, below: float, most: int):
    """A round stops after the first draft whose score is below `below` (that draft is proposed)."""
    def rule(record: Record):
        values = getattr(record, scores)

        def drafts_at(t: int) -> int:
            k = 1
            while k < most and t + k - 1 < len(values) and values[t + k - 1] >= below:
                k += 1
            return k
        return drafts_at
    return rule


def cumulative(scores: str, risk: float, most: int):
    """SpecDec++'s stop: a round stops once the chance that some draft so far is rejected, 1 - the product of the
    drafts' predicted acceptances, passes `risk`."""
    def rule(record: Record):
        values = getattr(record, scores)

        def drafts_at(t: int) -> int:
            k, reach = 1, values[t]
            while k < most and t + k < len(values) and 1 - reach <= risk:
                reach *= values[t + k]
                k += 1
            return k
        return drafts_at
    return rule


def oracle_plan(record: Record, costs: Costs, most: int) -> tuple[float, list[int]]:
    """The fewest seconds for the answer, and the drafts of each round on that path: best[t] = min over k <= the
    run of matches from t of round(k) + best[t + k + 1]. Drafting past a mismatch never helps: the round yields
    the same tokens for more seconds."""
    n = len(record.matches)
    best, choice = [0.0] * (n + 1), [0] * n
    for t in range(n - 1, -1, -1):
        run = run_of_matches(record.matches, t, min(most, n - t))
        best[t], choice[t] = min((costs.of_round(k) + best[min(n, t + k + 1)], k) for k in range(run + 1))
    plan, t = [], 0
    while t < n:
        plan.append(choice[t])
        t += choice[t] + 1
    return best[0], plan


class SimulatedClock:
    """`time.perf_counter` for `draft_stop` during a replay: advanced by the replayed costs."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ReplayedHead:
    """Stands in for the acceptance head: returns the recorded prediction of the position being drafted."""

    def __init__(self):
        self.next = 0.0

    def predict(self, hidden, probs) -> float:
        return self.next


def learned_seconds(records: list[Record], costs: Costs, most: int) -> tuple[float, int, int, int]:
    """`LearnedStop` over the answers in order (one rule kept across them, as a benchmark keeps it), on a clock the
    replay advances: -> seconds, tokens, drafts, rounds."""
    clock, head = SimulatedClock(), ReplayedHead()
    saved = draft_stop.time
    draft_stop.time = clock  # the rule reads only perf_counter
    try:
        rule = draft_stop.LearnedStop(head)
        seconds = drafted = rounds = 0
        logits = torch.zeros(1, 1)
        for record in records:
            t = 0
            while t < len(record.matches):
                start = clock.now
                k = 0
                for _ in range(min(rule.length(most), len(record.matches) - t)):
                    k += 1
                    clock.now += costs.draft
                    head.next = record.accept[t + k - 1]
                    if not rule.keep_going(draft_stop.Draft(k, logits, logits, True, None)):
                        break
                rule.drafted(k)
                clock.now += costs.verify[k + 1] + costs.round
                accepted = run_of_matches(record.matches, t, k)
                rule.update(accepted, k)
                seconds += clock.now - start
                drafted, rounds, t = drafted + k, rounds + 1, t + accepted + 1
        return seconds, sum(len(r.matches) for r in records), drafted, rounds
    finally:
        draft_stop.time = saved


def refit_threshold(scores: list[float], kept: list[bool], miss_weight: float = REFIT_MISS_WEIGHT) -> float:
    """The threshold transformers re-fits after each round (`AssistedCandidateGenerator.update_candidate_strategy`,
    transformers 5.23): over the drafts verified so far (top probability, accepted or not), the ROC curve's
    threshold of least fpr + miss_weight * fnr, a draft counting as kept at a score >= the threshold. Candidates
    are inf (no draft) and each score, highest first; the first least cost wins. (sklearn's `roc_curve` also drops
    collinear points, which can only change a tie, not the least cost.)"""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(kept, dtype=bool)
    candidates = np.concatenate([[math.inf], np.unique(s)[::-1]])  # [c]
    above = s[None, :] >= candidates[:, None]  # [c, drafts]
    fpr = (above & ~y).sum(1) / (~y).sum()
    fnr = 1 - (above & y).sum(1) / y.sum()
    return float(candidates[np.argmin(fpr + miss_weight * fnr)])


def refit_seconds(records: list[Record], costs: Costs, most: int) -> tuple[float, int, int, int]:
    """transformers' re-fitted confidence threshold over the answers in order (one rule kept across them): a round
    stops after a draft whose top probability is below the threshold; after the round, the drafts up to the first
    rejection join the verdicts (later ones are unknown) and, once there are more than 5 with both outcomes, the
    threshold is fitted again. -> seconds, tokens, drafts, rounds."""
    below, scores, kept = REFIT_START, [], []
    seconds = drafted = rounds = 0
    for record in records:
        t = 0
        while t < len(record.matches):
            k = min(threshold("top", below, most)(record)(t), len(record.matches) - t)  # as `replay` caps it
            accepted = run_of_matches(record.matches, t, k)
            verdicts = min(accepted + 1, k)
            scores += record.top[t:t + verdicts]
            kept += [True] * accepted + [False] * (verdicts - accepted)
            if len(scores) > 5 and any(kept) and not all(kept):
                below = refit_threshold(scores, kept)
            seconds += costs.of_round(k)
            drafted, rounds, t = drafted + k, rounds + 1, t + accepted + 1
    return seconds, sum(len(r.matches) for r in records), drafted, rounds


def rate(records: list[Record], costs: Costs, rule) -> float:
    """Tokens per second of a rule (record -> drafts_at) over the answers."""
    seconds = tokens = 0
    for record in records:
        s, n = replay(record, costs, rule(record))
        seconds, tokens = seconds + s, tokens + n
    if not seconds:  # every answer ended at its first token
        raise ValueError("no answer positions to replay: give a larger --max-new-tokens / --train-tokens")
    return tokens / seconds


def records_of(parts: list[tuple], head) -> list[Record]:
    """train_acceptance_head's (features, labels, top probability) per answer -> Records."""
    from sampling.acceptance_head import DISTRIBUTION_FEATURES

    out = []
    for x, labels, top in parts:
        with torch.no_grad():
            accept = torch.sigmoid(head(x.float())).tolist()
        entropy_nats = x[:, -DISTRIBUTION_FEATURES + 2].clamp_min(0)  # features(): ..., top2, entropy, log top
        out.append(Record(matches=[bool(v) for v in labels.tolist()], top=top.tolist(),
                          bound=(1 - entropy_nats.sqrt()).tolist(), accept=accept))
    return out


def measure_costs(widths: int, turns: int, passes: int = 8):
    """Median seconds of a drafter step (as the chat drafts: the 4-bit copy, the shortlist head) and of target
    passes of 1..widths rows, 200 positions held, each pass rolled back; every kind once per turn (the chat's own
    timing, `sampling.draft_cap.measure`)."""
    from sampling.draft_cap import measure
    from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, use_draft_vocab
    from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model

    drafter, tokenizer = load_model(DEFAULT_DRAFTER, int8=True, int4_drafter=True, progress=False)
    use_draft_vocab(drafter, tokenizer, DEFAULT_DRAFT_VOCAB)
    target = load_model(DEFAULT_TARGET, progress=False)[0]
    return measure(target, drafter, caps=range(widths), turns=turns, held=200, passes=passes)  # PassTimes


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser("benchmarks.draft_replay", __doc__)
    p.add_argument("--max-drafts", type=at_least(1), default=8, help="most drafts a round (fixed lengths 1..this)")
    p.add_argument("--max-new-tokens", type=at_least(2), default=128,
                   help="answer length of the held-out records (a label needs a token after the first)")
    p.add_argument("--train-tokens", type=at_least(2), default=96, help="answer length of the training records")
    p.add_argument("--turns", type=at_least(1), default=6, help="turns of the pass timings")
    p.add_argument("--round-ms", type=float, action="append",
                   help="a round's own work beyond its passes, ms (repeatable; default 0 and 4)")
    args = p.parse_args(argv)
    if any(not 0 <= ms < math.inf for ms in args.round_ms or []):  # nan too: every rate would be nan
        p.error("--round-ms must be a finite number of ms, at least 0")
    return args


def group_records(prompts: str, tokens: int, head) -> dict[str, list[Record]]:
    args = data_source.data_args(["--max-new-tokens", str(tokens)])
    args.collector = None
    return {group: records_of(parts, head) for group, parts in data_source.collect(args, prompts).items()}


def chosen_rules(train: dict[str, list[Record]], costs: Costs, most: int) -> tuple[dict, list[str]]:
    """Each threshold rule at its best value on the training prompts (the sum of the groups' rates)."""
    swept = {"confidence": (threshold, "top", CONFIDENCES), "entropy": (threshold, "bound", ENTROPY_BOUNDS),
             "SpecDec++ (head)": (cumulative, "accept", RISKS)}
    rules, chosen = {}, []
    for name, (family, scores, values) in swept.items():
        best = max(values, key=lambda v: sum(rate(rs, costs, family(scores, v, most)) for rs in train.values()))
        rules[name] = family(scores, best, most)
        chosen.append(f"{name} {best:g}")
    return rules, chosen


def group_row(group: str, records: list[Record], costs: Costs, rules: dict, most: int) -> str:
    """One table row: tokens/s (x AR) of every fixed length, rule and the oracle, and the gains over the best fixed."""
    ar_rate = 1 / costs.of_round(0)  # plain decoding: a one-row pass a token, through the same loop's round
    cell = lambda r: f"{r:.2f} ({r / ar_rate:.2f}x)"
    seconds, tokens, drafted, rounds = learned_seconds(records, costs, most)
    # each answer's seconds at each fixed length, replayed once: the lengths' rates and each answer's best
    by_answer = {g: [replay(r, costs, fixed(g)(r))[0] for r in records] for g in range(1, most + 1)}
    fixed_rates = {g: rate(records, costs, fixed(g)) for g in by_answer}  # one line where nothing replays
    best_g = max(fixed_rates, key=fixed_rates.get)
    per_answer = tokens / sum(min(answers) for answers in zip(*by_answer.values()))
    rule_rates = {name: rate(records, costs, rule) for name, rule in rules.items()}
    rule_rates["learned"] = tokens / seconds
    refit, _, refit_drafted, refit_rounds = refit_seconds(records, costs, most)
    rule_rates["refit"] = tokens / refit
    best_rule = max(rule_rates, key=rule_rates.get)
    plans = [oracle_plan(r, costs, most) for r in records]
    oracle = tokens / sum(s for s, _ in plans)
    oracle_drafts = sum(sum(plan) for _, plan in plans) / sum(len(plan) for _, plan in plans)
    matches = sum(sum(r.matches) for r in records) / tokens
    gain = lambda r: f"{r / fixed_rates[best_g] - 1:+.1%}"
    return (f"| {group} | {matches:.0%} | {ar_rate:.2f} | "
            + " | ".join(f"**{cell(r)}**" if g == best_g else cell(r) for g, r in fixed_rates.items())
            + " | " + " | ".join(cell(r) for name, r in rule_rates.items() if name != "refit")
            + f" ({drafted / rounds:.1f}) | {cell(rule_rates['refit'])} ({refit_drafted / refit_rounds:.1f})"
            + f" | {cell(per_answer)} | {cell(oracle)} ({oracle_drafts:.1f}) | {best_rule} "
            + f"{gain(rule_rates[best_rule])}, per answer {gain(per_answer)}, oracle {gain(oracle)} |")


def main(argv=None) -> None:
    from benchmarks.run import machine
    from sampling.acceptance_head import load_head

    args = parse_args(argv)
    head = load_head(None, None)
    train = group_records(data_source.data_args([]).prompts, args.train_tokens, head)
    held = group_records(data_source.data_args([]).held_out, args.max_new_tokens, head)
    times = measure_costs(args.max_drafts + 1, args.turns)
    draft, verify = times.draft, times.verify
    print(f"machine: {machine()}")  # after the models' load, which builds or loads the kernels it names
    print(times.describe())
    most = args.max_drafts
    for round_ms in args.round_ms or [0.0, 4.0]:
        costs = Costs(draft, verify, round_ms / 1e3)
        rules, chosen = chosen_rules(train, costs, most)
        print(f"\nround work {round_ms:g} ms; from the training prompts: {', '.join(chosen)}. Tokens/s after the "
              "first token (x AR):")
        print("| group | matches | AR | " + " | ".join(f"g{g}" for g in range(1, most + 1)) + " | "
              + " | ".join(rules) + " | learned (drafts/round) | refit (drafts/round) | best fixed per answer | "
              "oracle (drafts/round) | best rule, per answer, oracle vs best fixed |")
        print("|---" * (most + len(rules) + 8) + "|")
        for group, records in held.items():
            print(group_row(group, records, costs, rules, most))


if __name__ == "__main__":
    guarded(main)
