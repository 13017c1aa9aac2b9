"""The most drafts a speculative round proposes (`/gamma auto`), from this machine's own pass costs.

Under `confidence 0.9` (the chat's rule with the cache on) a round ends at its first unsure draft, so the cap
binds only in runs of sure drafts, and those are almost always right: on the training prompts 99.2-99.8% of the
drafts at a top probability of at least 0.9 equal the target's token. Whether a longer run pays then depends on
what one more draft costs: a drafter step and one more row of the verification pass. That differs by machine: a
7-row pass costs 1.6x a one-row pass on an AMX Xeon and 2.0x on a Zen 3. So the cap is chosen, as the kernels are,
from timings taken here: a drafter step and verification passes of cap + 1 rows, the cache on, in turns, kept in
the cache folder per CPU, kernel build and model pair. The cap maximises the tokens a second of a round of
confident drafts, each accepted with probability a:

    rate(cap) = (1 - a ** (cap + 1)) / (1 - a) / (cap * draft + verify(cap + 1))

(benchmarks/RESULTS.md, issue 23, forty-fourth pass: the model against replays and real runs).
Elsewhere (the cache off, where a round re-reads the sequence; other rules; sampling; NASD) the cap stays
FALLBACK_CAP, the one measured on the Zen 3 and Zen 5 machines.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.model_runner import ModelRunner, context_limit, output_size, synchronize
from utils.models.cache_folder import cache_root, mark_used, one_start_at_a_time, write_in_one_step

CONFIDENT_ACCEPTANCE = 0.994  # a: drafts at top probability >= 0.9 accepted, all training prompts (greedy)
MODEL_CONFIDENCE = 0.9  # the threshold `a` was measured at: a rule at least this strict lets fewer wrong ones through
# the caps weighed (a pass of cap + 1 rows timed for each); 12: the replay's widest. 3: on the Zen 3, where a row
# costs most, the model rates it 1.5-2.2% above 4; run with `confidence 0.9`, 3 read +0.8 / +4.6 / +3.0% against 4
# on the three groups (RESULTS.md, issue 23, sixty-third pass)
CAPS = (2, 3, 4, 6, 8, 10, 12)
FALLBACK_CAP = 6  # where no cap is measured (above); up to 6 beat up to 3 on the Zen 3 and Zen 5 (RESULTS.md)
HELD = 64  # positions in the cache while timing: a short conversation's (the pass cost hardly grows with them)
TURNS = 3  # timed turns (after one untimed); each times every width once, every other turn in reverse order


@dataclass
class PassTimes:
    """Median seconds of one drafter step and of a target verification pass by its rows."""
    draft: float
    verify: dict[int, float]

    def describe(self) -> str:
        """"drafter step 13.6 ms; verification by rows 3 45.9, 5 52.0 ms": the benchmarks' line."""
        return (f"drafter step {self.draft * 1e3:.1f} ms; verification by rows "
                + ", ".join(f"{w} {s * 1e3:.1f}" for w, s in self.verify.items()) + " ms")


def round_rate(costs: PassTimes, cap: int, a: float = CONFIDENT_ACCEPTANCE) -> float:
    """Tokens a second of a round that drafts `cap` confident drafts: the expected accepted run plus the target's
    own token, over `cap` drafter steps and a (cap + 1)-row pass."""
    tokens = (1 - a ** (cap + 1)) / (1 - a)
    return tokens / (cap * costs.draft + costs.verify[cap + 1])


def best_cap(costs: PassTimes, a: float = CONFIDENT_ACCEPTANCE) -> int:
    caps = [c for c in CAPS if c + 1 in costs.verify]
    return max(caps, key=lambda c: round_rate(costs, c, a))


def applies(rule, greedy: bool) -> bool:
    """Whether a measured cap suits the round's rule (a DraftStopConfig): confidence at MODEL_CONFIDENCE or above,
    greedy (the acceptance `a` is greedy verification's; sampled, nucleus 0.7 0.9, 12 against 6 read -0.9 / -1.6 /
    +0.5% on the AMX Xeon: RESULTS.md, forty-sixth pass)."""
    return rule.rule == "confidence" and rule.confidence >= MODEL_CONFIDENCE and not rule.adaptive and greedy


@torch.no_grad()
def measure(target: torch.nn.Module, drafter: torch.nn.Module, caps=CAPS, turns: int = TURNS, held: int = HELD,
            passes: int = 1) -> PassTimes:
    """A drafter step and verification passes of cap + 1 rows for each cap, `held` positions in each cache, each
    pass rolled back after (as a rejected round's is); a sample is the mean of `passes` passes, the result the
    median of `turns` samples. `benchmarks.draft_replay` times its rounds' costs here too."""
    from utils.models.draft_vocab import start_shortlist

    widths = sorted({c + 1 for c in caps})
    limits = [n for n in (context_limit(target), context_limit(drafter)) if n is not None]
    held = min([held] + [n - max(widths) for n in limits])  # a short context holds fewer
    if held < 1:
        raise ValueError(f"a context of {min(limits)} positions is too short to time passes of {max(widths)} rows")
    vocab = min(output_size(target), output_size(drafter), 1000)
    ids = torch.randint(0, vocab, (1, held + max(widths)), generator=torch.Generator().manual_seed(0))
    runners = {"target": ModelRunner(target, use_cache=True), "drafter": ModelRunner(drafter, use_cache=True)}
    seqs = {name: ids.to(r.device) for name, r in runners.items()}
    start_shortlist(drafter)  # a shortlist head hears only random ids here, and forgets them after
    try:
        for name, runner in runners.items():
            runner.logits(seqs[name][:, :held], 1)  # the held positions
        kinds = [("drafter", 1)] + [("target", w) for w in widths]
        samples: dict[tuple[str, int], list[float]] = {kind: [] for kind in kinds}
        for turn in range(turns + 1):
            for name, w in kinds if turn % 2 else kinds[::-1]:
                runner = runners[name]
                synchronize(runner.device)
                start = time.perf_counter()
                for _ in range(passes):
                    runner.logits(seqs[name][:, :held + w], w)  # rolls back to `held`, then feeds w rows
                synchronize(runner.device)
                if turn:  # the first turn warms up
                    samples[(name, w)].append((time.perf_counter() - start) / passes)
    finally:
        start_shortlist(drafter)
    median = {kind: statistics.median(v) for kind, v in samples.items()}
    return PassTimes(median[("drafter", 1)], {w: median[("target", w)] for w in widths})


def fingerprint(model: torch.nn.Module) -> str:
    """What a pass's cost depends on, not the weights' values nor where they were read from: the config without its
    path, every module's class, every tensor's name, shape and dtype (a quantisation, a kernel layout, a shortlist
    head), the device."""
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    parts = [json.dumps(config, sort_keys=True, default=str), str(model.device)]
    parts += [f"{name}:{type(m).__name__}" for name, m in model.named_modules()]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def device_facts(device: torch.device) -> dict:
    """A GPU's model and CUDA version (a shared home folder, a swapped card); on CPU, `cpu_description` says all."""
    if device.type != "cuda":
        return {}
    return {"gpu": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
            "cuda": torch.version.cuda}


def cache_key(target: torch.nn.Module, drafter: torch.nn.Module) -> str:
    """The cache entry's name. The caller forgets a shortlist head's conversation first (`start_shortlist`): its
    extra rows would make the key depend on what was said."""
    from utils.models.kernel_choice import cpu_description

    facts = {"cap": 1, "caps": CAPS, "a": CONFIDENT_ACCEPTANCE, **cpu_description(),
             **{f"{role} {k}": v for role, m in (("target", target), ("drafter", drafter))
                for k, v in device_facts(m.device).items()},
             "target": fingerprint(target), "drafter": fingerprint(drafter)}
    return hashlib.sha1(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def load_or_measure(target: torch.nn.Module, drafter: torch.nn.Module, note=None) -> tuple[int, PassTimes]:
    """(the cap, the costs it came from), from the cache folder or timed now (`note(text)` says so first) and
    saved there; by one start at a time, so that two starts at once do not time each other's load."""
    from utils.models.draft_vocab import start_shortlist

    start_shortlist(drafter)  # every generation starts by forgetting the last one's ids anyway
    path = cache_root() / f"draft-cap-{cache_key(target, drafter)}.json"
    costs = saved_costs(path)
    if costs is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # said below, where the timing cannot be saved either
        with one_start_at_a_time(path.parent, "draft-cap", "timing the verification passes", note is not None):
            costs = saved_costs(path)  # timed by another start while this one waited
            if costs is None:
                costs = measure_and_save(target, drafter, path, note)
    return best_cap(costs), costs


def saved_costs(path: Path) -> PassTimes | None:
    """The costs saved at `path` (marked used), or None: none yet, unreadable, or from another version."""
    try:
        data = json.loads(path.read_text())
        costs = PassTimes(float(data["draft"]), {int(w): float(s) for w, s in data["verify"].items()})
        if not {c + 1 for c in CAPS} <= set(costs.verify):
            raise ValueError("a width this version times is missing")
        if not all(0 < t < math.inf for t in (costs.draft, *costs.verify.values())):
            raise ValueError("a timing that is not a positive number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    mark_used(path)
    return costs


def measure_and_save(target: torch.nn.Module, drafter: torch.nn.Module, path: Path, note) -> PassTimes:
    if note is not None:
        note("(timing this machine's verification passes once, to choose the most drafts a round: /gamma auto)")
    costs = measure(target, drafter)
    try:
        saved = write_in_one_step(path, json.dumps({"draft": costs.draft, "verify": costs.verify}).encode())
    except OSError:
        saved = False
    if not saved and note is not None:
        note(f"(the timing could not be saved in {path.parent}: it runs again at the next start)")
    return costs
