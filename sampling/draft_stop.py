"""How many drafts a round proposes: the rules behind `--draft-stop`.

A rule looks only at the drafter's side (its distributions and hidden state, how earlier rounds went, how long
passes took), never at the target's verdict on the round it decides. Stopping early therefore changes how many
drafts the target verifies and nothing else: greedy output equals AR and sampled output keeps the target's
distribution, whatever the rule (tests/test_draft_stop.py).

- fixed: `gamma` drafts every round.
- adaptive: the length follows acceptance (+2 after a fully accepted round, -1 after a rejection).
- confidence: a round stops after a draft whose top probability is below P (transformers' assistant threshold).
- entropy: a round stops once AdaEDL's lower bound on the next draft's acceptance, 1 - sqrt(H) with the
  drafter's entropy H in nats (its scale at 1), falls below a bound; the bound comes from a measured sweep.
- auto: confidence P with the KV cache on (P as given, 0.9 by default), confidence 0.6 with it off (0.75 when
  sampling). With the cache on, a verification pass of 4 rows costs ~1.25 of 1 row and a draft a quarter of a
  round, so stopping before likely rejections pays (chat +12-16%, code -1..-3% against fixed gamma 3). With it
  off, every round is a whole pass of the sequence, so a draft adds one nearly free row to the verification but
  costs a drafter pass (~0.3 of the target's): long rounds pay where drafts are likely right, and a lower
  threshold stops them where they are not (benchmarks/RESULTS.md, issue 23, twenty-first and twenty-fifth passes).
- learned: SpecDec++'s acceptance head predicts each draft's chance of being accepted; drafting goes on while
  one more draft adds expected tokens faster than the round's average, with the seconds of drafter steps and of
  each verification width measured on this machine as rounds go (`PassCosts`). It may draft nothing in a round
  where a draft cannot pay, so on a CPU where wide passes cost almost as much as separate ones it falls back to
  plain decoding, probing ever more rarely.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from utils.arguments import flag, real

DRAFT_STOPS = ("fixed", "adaptive", "confidence", "entropy", "learned", "auto")


@dataclass
class DraftStopConfig:
    rule: str = "fixed"  # one of DRAFT_STOPS
    # confidence: stop after a draft whose top probability is below this. 0.9: the best of 0.2-0.98 for the
    # embedded pair in `benchmarks.draft_replay`'s sweep on the training prompts, in every cost sample; 0.4
    # (transformers' assistant default) ran 8-15% below 0.9 in real runs (benchmarks/RESULTS.md, issue 23)
    confidence: float = 0.9
    entropy_bound: float = 0.5  # entropy: stop once 1 - sqrt(H) < this (H > 0.25 nats); chosen by a sweep
    head: str | None = None  # learned: the acceptance head's file (None: the one shipped for the embedded drafter)
    adaptive: bool = False  # confidence or entropy: their length schedule follows acceptance too (--adaptive)

    def __post_init__(self):
        if self.rule not in DRAFT_STOPS:
            raise ValueError(f"unknown draft stop {self.rule!r}; use one of {', '.join(DRAFT_STOPS)}")
        if not 0.0 <= real("confidence", self.confidence) < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {self.confidence}")
        if not 0.0 <= real("the entropy bound", self.entropy_bound) < 1.0:
            raise ValueError(f"the entropy bound must be in [0, 1), got {self.entropy_bound}")
        if flag("adaptive", self.adaptive) and self.rule not in ("confidence", "entropy"):
            raise ValueError("adaptive=True puts a confidence or entropy rule on an adaptive length; "
                             f"for {self.rule!r} use the rule 'adaptive'")
        if self.head is not None and not isinstance(self.head, (str, os.PathLike)):
            raise ValueError(f"head must be a file's path, got {self.head!r}")
        if self.head is not None and self.rule != "learned":  # it would be ignored without a word
            raise ValueError(f"a head file is read only by the rule 'learned', not {self.rule!r}")

    def describe(self) -> str:
        detail = {"confidence": f" {self.confidence:g}", "entropy": f" {self.entropy_bound:g}"}.get(self.rule, "")
        return self.rule + detail + (" + adaptive" if self.adaptive and self.rule in ("confidence", "entropy") else "")


@dataclass
class Draft:
    """What a rule may read after each draft of a round; the softmax is taken only by the rules that read it.

    Every rule reads its distribution through the top probabilities and the entropy, which tokens of probability
    0 do not change; so where the drafter's head computes only a shortlist (`--draft-vocab`), the rules read the
    shortlist's entries alone: 33k of 152k for the embedded drafter, which made the head's features 3x cheaper
    (0.45 -> 0.15 ms a draft on the Zen 5 of RESULTS.md, issue 23)."""
    index: int  # 1 for the round's first draft
    logits: Tensor  # [1, vocab]: the drafter's raw logits
    q: Tensor  # [1, vocab]: what the draft was drawn from
    greedy: bool  # greedy's q is one-hot, so its rules read `probs` instead
    hidden: Tensor | None  # [1, hidden]: the drafter's last hidden state (the head's input), when asked for
    support: Tensor | None = None  # [n]: the ids outside which the logits are -inf (a shortlist head), if known

    def on_support(self, x: Tensor) -> Tensor:
        return x if self.support is None else x.index_select(-1, self.support)  # [1, n]

    @cached_property
    def probs(self) -> Tensor:
        """[1, n]: the drafter's softmax at temperature 1 over its support, untruncated (the head's features)."""
        return torch.softmax(self.on_support(self.logits).float(), dim=-1)

    @property
    def sampled(self) -> Tensor:
        """[1, n]: the distribution the confidence and entropy rules read."""
        return self.probs if self.greedy else self.on_support(self.q)


# What a built rule has (DraftStop's members): checked by name, since a Protocol is not an isinstance test
DRAFT_STOP_MEMBERS = ("needs_hidden", "length", "keep_going", "drafted", "update")


class DraftStop(Protocol):
    needs_hidden: bool

    def length(self, gamma: int) -> int:
        """Most drafts of the coming round (0: this round is the target's alone)."""

    def keep_going(self, draft: Draft) -> bool:
        """After a draft: whether to draft another (it is proposed either way)."""

    def drafted(self, num_drafted: int) -> None:
        """The round's drafting ended after `num_drafted` drafts; its verification starts."""

    def update(self, num_accepted: int, num_drafted: int) -> None:
        """The round's verdict."""


class AdaptiveLength:
    """Draft length that follows acceptance (as transformers' assisted generation does): +2 after a round whose
    drafts were all accepted, -1 after a rejection, never below 1 nor above the loop's gamma. An answer's last
    rounds ask for fewer (its budget), which bounds those rounds but not the length learned."""

    def __init__(self):
        self.length: int | None = None
        self.widest = 1  # the most drafts the loop has asked for: the length's ceiling

    def next(self, gamma: int) -> int:
        self.widest = max(self.widest, gamma)
        self.length = min(gamma if self.length is None else self.length, self.widest)
        return min(self.length, gamma)

    def update(self, num_accepted: int, num_drafted: int) -> None:
        if num_drafted > 0 and self.length is not None:
            self.length = self.length + 2 if num_accepted == num_drafted else max(1, self.length - 1)


def top_probability(probs: Tensor) -> float:
    return probs.max().item()  # one host sync per draft, only for the rules that read it


def entropy(probs: Tensor) -> Tensor:
    """probs: [n, vocab] -> the entropy of each row in nats, [n, 1]. One fused pass (`entr(0)` is 0): the
    clamp, log, product and sum it replaced cost 1.3 ms a draft over 152k tokens on the Zen 3 of RESULTS.md, a
    fifteenth of a drafter step."""
    return torch.special.entr(probs.float()).sum(-1, keepdim=True)


def entropy_bound(probs: Tensor) -> float:
    """AdaEDL's lower bound on the acceptance of a draft from `probs` ([1, vocab]): 1 - sqrt(H)."""
    return 1.0 - math.sqrt(max(entropy(probs).item(), 0.0))  # one host sync per draft


class RuleStop:
    """fixed, adaptive, confidence and entropy: a length schedule, and a test after each draft."""

    needs_hidden = False

    def __init__(self, adaptive: bool = False, confidence: float = 0.0, bound: float | None = None):
        self.schedule = AdaptiveLength() if adaptive else None
        self.confidence, self.bound = confidence, bound  # bound None: no entropy test (0 is a bound: H > 1 nat)

    def length(self, gamma: int) -> int:
        return self.schedule.next(gamma) if self.schedule is not None else gamma

    def keep_going(self, draft: Draft) -> bool:
        if self.confidence and top_probability(draft.sampled) < self.confidence:
            return False
        return self.bound is None or entropy_bound(draft.sampled) >= self.bound

    def drafted(self, num_drafted: int) -> None:
        pass

    def update(self, num_accepted: int, num_drafted: int) -> None:
        if self.schedule is not None:
            self.schedule.update(num_accepted, num_drafted)


class PassCosts:
    """Seconds of one drafter step and of a verification pass of each width, as measured on this machine over
    the last rounds (exponential averages). A width not measured yet, or not for a while, is extrapolated from those
    that were."""

    SMOOTHING = 0.2  # weight of the newest round in the averages
    ROW_COST = 0.25  # until two widths are measured, each extra row costs this fraction of a one-row pass
    # Drafting rounds after which a width not measured again is forgotten, and extrapolated from those measured
    # since. A width timed dear in a slow moment (or at its first pass in the process) made the rounds stop short
    # of it, so it was never timed again: on the Zen 3 of RESULTS.md 5 rows stayed at 120 ms (87 ms timed in turns)
    # and 4 at 86 (70) for a whole run, and the rule drafted 1-2 a round at 98% acceptance. Rounds without drafts
    # do not count, so that a rule that stopped drafting where drafts cannot pay keeps to its rare probes.
    FORGET_AFTER = 64

    def __init__(self):
        self.draft: float | None = None  # seconds per drafter step
        self.verify_by_width: dict[int, float] = {}
        self.drafting_rounds = 0  # verification passes of 2 rows or more measured
        self.measured_at: dict[int, int] = {}  # width: `drafting_rounds` when it was last measured

    def observe_draft(self, seconds: float, steps: int) -> None:
        self.draft = average(self.draft, seconds / steps, self.SMOOTHING)

    def observe_verify(self, width: int, seconds: float) -> None:
        self.drafting_rounds += width > 1
        self.verify_by_width[width] = average(self.verify_by_width.get(width), seconds, self.SMOOTHING)
        self.measured_at[width] = self.drafting_rounds
        stale = self.drafting_rounds - self.FORGET_AFTER
        for w in [w for w in self.verify_by_width if self.measured_at.get(w, 0) < stale]:
            del self.verify_by_width[w]
            self.measured_at.pop(w, None)

    def verify(self, width: int) -> float:
        known = self.verify_by_width
        if width in known:
            return known[width]
        if not known:
            return 1.0 + self.ROW_COST * (width - 1)  # in units of a one-row pass: only ratios matter then
        below = [w for w in known if w < width]
        above = [w for w in known if w > width]
        if below and above:  # between two measured widths: linear
            lo, hi = max(below), min(above)
            return known[lo] + (known[hi] - known[lo]) * (width - lo) / (hi - lo)
        ws = sorted(known)
        if len(ws) > 1:
            slope = (known[ws[-1]] - known[ws[0]]) / (ws[-1] - ws[0])
        else:  # one width w measured: its pass is 1 + ROW_COST * (w - 1) one-row passes
            slope = self.ROW_COST * known[ws[0]] / (1.0 + self.ROW_COST * (ws[0] - 1))
        near = max(below) if below else min(above)
        return max(known[near] + slope * (width - near), 1e-6)


def average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class LearnedStop:
    """The acceptance head's predictions weighed against this machine's measured pass costs.

    With k drafts whose predicted acceptances are a_1..a_k, a round yields E(k) = 1 + sum_i prod_{j<=i} a_j
    tokens in T(k) = k * draft + verify(k + 1) seconds. Another draft adds about prod_{j<=k} a_j * a_k tokens (the
    next draft is predicted as likely as the last) for draft + verify(k + 2) - verify(k + 1) seconds: drafting
    goes on while that marginal rate beats the round's average E(k) / T(k). Before a round, the first draft is
    judged the same way from the running acceptance of first drafts."""

    needs_hidden = True
    # Rounds without drafts before a round drafts anyway, to measure again what drafting costs; doubled after each
    # probe. A probe makes the drafter read everything since its last pass: on the 2-core Zen 1 one probe in a
    # 128-token answer made it 15% slower (probes every 32 rounds, benchmarks/RESULTS.md), hence rare ones.
    PROBE_EVERY = 256
    SMOOTHING = 0.1  # weight of the newest round in the first drafts' acceptance

    def __init__(self, head, costs: PassCosts | None = None):
        self.head = head
        self.costs = costs or PassCosts()
        self.first_acceptance = 1.0  # optimistic until measured, so that the first rounds measure drafting
        self.idle_rounds = 0
        self.probe_after = self.PROBE_EVERY
        self.steady: float | None = None  # when its first draft was made: later steps read one token each
        self.verifying: float | None = None  # when its verification started
        self.reach = self.expected = 1.0  # prod a_j, and E(k)

    def length(self, gamma: int) -> int:
        self.reach, self.expected = 1.0, 1.0
        if gamma > 0 and not self.pays(0, self.first_acceptance):
            self.idle_rounds += 1
            if self.idle_rounds < self.probe_after:
                self.verifying = time.perf_counter()  # the target's pass alone: a one-row verification
                return 0
            self.probe_after *= 2
        else:
            self.probe_after = self.PROBE_EVERY
        self.idle_rounds = 0
        return gamma

    def keep_going(self, draft: Draft) -> bool:
        if draft.index == 1:
            self.steady = time.perf_counter()
        a = self.head.predict(draft.hidden, draft.probs)  # one host sync per draft
        self.reach *= a
        self.expected += self.reach
        return self.pays(draft.index, a)

    def pays(self, k: int, next_acceptance: float) -> bool:
        """Whether a (k+1)-th draft, accepted with `next_acceptance` if the first k are, raises the round's rate."""
        draft = self.costs.draft or 0.0
        spent = k * draft + self.costs.verify(k + 1)
        extra = draft + self.costs.verify(k + 2) - self.costs.verify(k + 1)
        gain = self.reach * next_acceptance
        return gain * spent >= self.expected * max(extra, 1e-9)

    def drafted(self, num_drafted: int) -> None:
        # A round's first step also reads what the drafter has not seen yet: the whole prompt in an answer's first
        # round, everything since its last pass after idle rounds. Timed in, that made a prompt's prefill look
        # like the price of every draft, and the rule stopped drafting for good on the Xeon of RESULTS.md where
        # drafting pays 1.2x; so the cost per draft is timed over the steps after the first. Until a round has
        # two drafts it stays unmeasured (free), which lets the next rounds draft and measure it.
        now = time.perf_counter()
        if self.steady is not None and num_drafted > 1:
            self.costs.observe_draft(now - self.steady, num_drafted - 1)
        self.steady, self.verifying = None, now

    def update(self, num_accepted: int, num_drafted: int) -> None:
        if self.verifying is not None:
            self.costs.observe_verify(num_drafted + 1, time.perf_counter() - self.verifying)
        self.verifying = None
        if num_drafted > 0:
            self.first_acceptance = average(self.first_acceptance, float(num_accepted > 0), self.SMOOTHING)


def alias_config(adaptive: bool, confidence: float) -> DraftStopConfig:
    """The rule the older adaptive/confidence switches spell (together: confidence on an adaptive length)."""
    if confidence:
        return DraftStopConfig("confidence", confidence=confidence, adaptive=adaptive)
    return DraftStopConfig("adaptive" if adaptive else "fixed")


# auto's thresholds with the cache off, at up to 6 drafts, 35 tokens (the chat's length), the drafter reading 32
# positions (`--drafter-window auto`), Zen 5 (RESULTS.md, issue 23, twenty-first and twenty-fifth passes):
# - greedy: the best of 0.5 / 0.6 / 0.75 on the training prompts, 0.96x / 0.95x / 0.92x the time of 0.75
#   (code-writing / code-editing / chat); held out, two runs in turns, 0.96x / 0.96x / 0.98x. (0.75 had been the
#   best of 0.3-0.9 while the drafter read the whole sequence.)
# - sampled (nucleus T 0.7, P 0.9, held out, 4 seeds): 0.75 above 0.6 in every group (tokens/s +3..+6%) and above
#   0.9 (+1..+8%, 2 seeds). A sampled draft is accepted with probability min(1, p/q), below a greedy one's, so
#   the round does better to stop sooner.
CACHE_OFF_CONFIDENCE = 0.6
CACHE_OFF_SAMPLED_CONFIDENCE = 0.75


def resolve(config: DraftStopConfig, use_cache: bool, greedy: bool = True) -> DraftStopConfig:
    """`auto` made the rule it stands for with the cache on or off, greedy or sampled; every other config as it is."""
    if config.rule != "auto":
        return config
    if use_cache:
        return DraftStopConfig("confidence", confidence=config.confidence)
    return DraftStopConfig("confidence", confidence=CACHE_OFF_CONFIDENCE if greedy else CACHE_OFF_SAMPLED_CONFIDENCE)


def make_draft_stop(config: DraftStopConfig | str, drafter: torch.nn.Module | None = None,
                    use_cache: bool = True, greedy: bool = True) -> DraftStop:
    """The rule `config` names (a config, or a rule's name with its defaults; `auto`: for a cache on or off, greedy
    or sampled decoding); `learned` loads its head and checks it was trained for `drafter`."""
    if isinstance(config, str):
        config = DraftStopConfig(config)
    if not isinstance(config, DraftStopConfig):
        raise ValueError(f"the rule must be a DraftStopConfig or a rule's name, got {config!r}")
    config = resolve(config, use_cache, greedy)
    if config.rule == "learned":
        from sampling.acceptance_head import load_head

        head = load_head(config.head, drafter)
        return LearnedStop(head.to(drafter.device) if drafter is not None else head)
    return RuleStop(adaptive=config.adaptive or config.rule == "adaptive",
                    confidence=config.confidence if config.rule == "confidence" else 0.0,
                    bound=config.entropy_bound if config.rule == "entropy" else None)
