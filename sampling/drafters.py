"""Drafters plug into the one speculative loop (`sampling.loop.generate`).

A drafter proposes up to `gamma` tokens after the current sequence (`get_candidates`) and hears back how many
were accepted (`update_candidate_strategy`). It returns its distribution `q` when it samples from one, or `None`
when its proposals are deterministic, which selects the matching verification rule.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from utils.logits_processor import LogitsProcessor
from utils.model_runner import ModelRunner, input_size


class Drafter(Protocol):
    calls: int

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        """seq: [1, L] -> drafts [1, g <= gamma], q [1, g, vocab] or None."""

    def update_candidate_strategy(self, seq: Tensor, num_accepted: int, num_drafted: int, target_logits: Tensor) -> None:
        """seq: [1, L'] after the round; target_logits: [1, g+1, vocab] of the verification pass."""


class AdaptiveLength:
    """Draft length that follows acceptance (as transformers' assisted generation does): +2 after a round whose
    drafts were all accepted, -1 after a rejection, never below 1 nor above the loop's gamma."""

    def __init__(self):
        self.length: int | None = None

    def next(self, gamma: int) -> int:
        self.length = gamma if self.length is None else min(self.length, gamma)
        return self.length

    def update(self, num_accepted: int, num_drafted: int) -> None:
        if num_drafted > 0 and self.length is not None:
            self.length = self.length + 2 if num_accepted == num_drafted else max(1, self.length - 1)


class DoublingLength:
    """Draft length for copying drafters: `start` after a rejection, doubled after a round whose drafts were all
    accepted, never above the loop's gamma. A rejected draft still widens the verification pass (on the CPU
    benchmark a pass over 9 tokens costs ~1.6-1.8 one-token passes, over 3 tokens ~1.15-1.2), so a copy earns
    long drafts by being right, and a wrong guess costs a short draft."""

    def __init__(self, start: int = 3):
        if start < 1:
            raise ValueError(f"start must be >= 1, got {start}")
        self.start = start
        self.length = start

    def next(self, gamma: int) -> int:
        self.length = min(self.length, gamma)
        return self.length

    def update(self, num_accepted: int, num_drafted: int) -> None:
        if num_drafted > 0:
            self.length = self.length * 2 if num_accepted == num_drafted else self.start


class NoDrafter:
    """Drafts nothing: the loop then is plain autoregressive decoding."""

    calls = 0

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        return seq.new_zeros((1, 0)), None

    def update_candidate_strategy(self, seq, num_accepted, num_drafted, target_logits) -> None:
        pass


class ModelDrafter:
    """A small model that samples `gamma` tokens autoregressively with the same processor as the target.

    With `confidence` > 0 it stops drafting after a token whose top probability fell below it (transformers'
    `assistant_confidence_threshold`): past an uncertain token the next drafts are likely rejected, and each
    one widens the verification pass. The stop depends only on the drafter's own distribution, so the output
    distribution is unchanged.
    """

    def __init__(self, runner: ModelRunner, processor: LogitsProcessor, target_vocab_size: int, adaptive: bool = False,
                 confidence: float = 0.0):
        if not 0.0 <= confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.runner = runner
        self.processor = processor
        self.target_vocab_size = target_vocab_size
        self.adaptive = AdaptiveLength() if adaptive else None
        self.confidence = confidence
        self.input_size = input_size(runner.model)
        self.checked = 0  # positions of the sequence already known to be ids the drafter can read

    def check_readable(self, seq: Tensor) -> None:
        """A target may emit ids past the drafter's embedding (a larger vocabulary): say so instead of an
        IndexError deep in the drafter's forward. One host sync per round, for the new tokens only."""
        new = seq[0, self.checked :]
        if new.numel() and int(new.max()) >= self.input_size:
            token = int(new[new >= self.input_size][0])
            raise ValueError(f"token id {token} is outside the drafter's vocabulary of {self.input_size} ids; "
                             "the drafter must read every id the target can emit")
        self.checked = seq.shape[1]

    @property
    def calls(self) -> int:
        return self.runner.calls

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        if self.adaptive is not None:
            gamma = self.adaptive.next(gamma)
        if self.runner.limit is not None:
            gamma = min(gamma, self.runner.limit + 1 - seq.shape[1])
        self.check_readable(seq)
        length = seq.shape[1]
        qs = []
        for _ in range(max(gamma, 0)):
            logits = self.align(self.runner.logits(seq, 1)[:, -1])  # [1, vocab]
            q = self.processor(logits)  # [1, vocab]
            x = self.processor.sample(q)  # [1]
            seq = torch.cat([seq, x.view(1, 1)], dim=1)
            qs.append(q)
            # One host sync per drafted token, only with the early stop on (a GPU waits here; a CPU does not).
            if self.confidence and self.top_probability(logits, q) < self.confidence:
                break
        if not qs:
            return seq.new_zeros((1, 0)), None
        return seq[:, length:], torch.stack(qs, dim=1)  # [1, g], [1, g, vocab]

    def top_probability(self, logits: Tensor, q: Tensor) -> float:
        """logits, q: [1, vocab]. Greedy's q is one-hot, so its confidence is the softmax of the raw logits."""
        probs = torch.softmax(logits.float(), dim=-1) if self.processor.is_greedy else q
        return probs.max().item()

    def align(self, logits: Tensor) -> Tensor:
        """Expresses the drafter's logits over the target's vocabulary (padded vocabularies differ in size)."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.target_vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def update_candidate_strategy(self, seq, num_accepted, num_drafted, target_logits) -> None:
        if self.adaptive is not None:
            self.adaptive.update(num_accepted, num_drafted)
