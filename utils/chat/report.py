"""What one generator's answer to one prompt measured, as the chat prints it and `--json` writes it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class Report:
    generator: str
    text: str
    token_ids: list[int]
    tokens_generated: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None
    speedup: float | None  # over the target's autoregressive decoding of the same prompt
    target_forwards: int
    drafter_forwards: int
    error: str | None = None  # "ExceptionType: message"
    first_token_s: float | None = None  # prefill and the first round: what a user waits before text appears
    drafted: int = 0  # tokens proposed by the drafter (model or n-gram storage)
    accepted: int = 0  # of them, kept by the target
    rounds: int = 0  # verification passes: drafted / rounds is the mean draft length
    draft_stop: str | None = None  # speculative: the rule that chose the draft lengths
    gamma: int | None = None  # speculative and NASD: the most drafts a round (`/gamma`; auto: as chosen)



def counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def stats_line(r: Report, no_baseline: str = "/target is off") -> str:
    """no_baseline: why there is no speedup (where `r.speedup` is None)."""
    parts = [counted(r.tokens_generated, "token"), f"{r.seconds:.2f} s"]
    if r.first_token_s is not None:
        parts.append(f"first token {r.first_token_s:.2f} s")
    parts.append(f"{r.tokens_per_s:.2f} tokens/s")
    if r.draft_stop is not None and r.rounds:
        cap = f", at most {r.gamma}" if r.gamma is not None else ""
        parts.append(f"{r.drafted / r.rounds:.1f} drafts/round ({r.draft_stop}{cap})")
    if r.acceptance_rate is not None:
        parts.append(f"acceptance {r.acceptance_rate:.0%}")
    elif r.generator in ("speculative", "ngram"):
        parts.append("acceptance n/a (nothing drafted)")
    parts.append(counted(r.target_forwards, "target forward") if r.generator != "drafter"
                 else counted(r.drafter_forwards, "drafter forward"))
    parts.append(f"speedup {r.speedup:.2f}x" if r.speedup is not None else f"speedup n/a ({no_baseline})")
    return " · ".join(parts)


def report_json(r: Report) -> str:
    return json.dumps(asdict(r))
