"""Drafters plug into the one speculative loop (`sampling.loop.generate`).

A drafter proposes up to `gamma` tokens after the current sequence (`get_candidates`) and hears back how many
were accepted (`update_candidate_strategy`). It returns its distribution `q` when it samples from one (rejection
sampling then verifies), or `None` to have each draft kept while it equals the token drawn from the target's `p`:
exact for any drafts that do not depend on the target's draws (n-grams, greedy, translated text).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Protocol

import torch
from torch import Tensor

from sampling.draft_stop import Draft, DraftStop, RuleStop
from utils.arguments import count
from utils.logits_processor import LogitsProcessor
from utils.model_runner import ModelRunner, input_size
from utils.models.draft_vocab import start_shortlist


class Drafter(Protocol):
    calls: int

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        """seq: [1, L] -> drafts [1, g <= gamma], q [1, g, vocab] or None."""

    def update_candidate_strategy(self, seq: Tensor, num_accepted: int, num_drafted: int, target_logits: Tensor) -> None:
        """seq: [1, L'] after the round; target_logits: [1, g+1, vocab] of the verification pass."""


class DoublingLength:
    """Draft length for copying drafters: `start` after a rejection, doubled after a round whose drafts were all
    accepted, never above the loop's gamma. A rejected draft still widens the verification pass (on the CPU
    benchmark a pass over 9 tokens costs ~1.6-1.8 one-token passes, over 3 tokens ~1.15-1.2), so a copy earns
    long drafts by being right, and a wrong guess costs a short draft."""

    def __init__(self, start: int = 3):
        self.start = count("start", start, 1)
        self.length = self.start
        self.widest = 1  # the most drafts the loop has asked for: the length's ceiling (last rounds ask fewer)

    def next(self, gamma: int) -> int:
        self.widest = max(self.widest, gamma)
        self.length = min(self.length, self.widest)
        return min(self.length, gamma)

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


# What a drafter reads in place of a target id past its embedding (`ModelDrafter.readable`): any id keeps the
# output exact; 0 is one every vocabulary has.
UNREADABLE_AS = 0


class ModelDrafter:
    """A small model that samples up to `gamma` tokens autoregressively with the same processor as the target;
    how many a round drafts is the choice of its `stop` rule (`sampling/draft_stop.py`), which reads only the
    drafter's side, so the output distribution is unchanged.
    """

    def __init__(self, runner: ModelRunner, processor: LogitsProcessor, target_vocab_size: int,
                 stop: DraftStop | None = None):
        self.runner = runner
        self.processor = processor
        self.target_vocab_size = target_vocab_size
        self.stop = stop or RuleStop()
        self.input_size = input_size(runner.model)
        self.checked = 0  # positions of the sequence already checked for ids past the drafter's embedding
        self.unreadable = False  # whether the sequence holds such an id (read then as `UNREADABLE_AS`)
        self.hidden: Tensor | None = None  # [1, hidden]: the last position's input to the output layer
        start_shortlist(runner.model)  # it hears this generation's sequence in `readable`

    def readable(self, seq: Tensor) -> Tensor:
        """`seq` [1, L] as the drafter reads it. A target whose head is padded past the drafter's (Qwen2.5-7B's
        152,064 ids against the 0.5B's 151,936) may sample an id the drafter has no embedding for: the drafter reads
        `UNREADABLE_AS` there instead. Exact whatever it reads, since the target verifies every draft; only the
        drafts that follow are less likely kept. A shortlist head hears of the new tokens. One host sync per round,
        for the new tokens only."""
        new = seq[0, self.checked :]
        if new.numel() and int(new.max()) >= self.input_size:
            self.unreadable = True
        include = getattr(self.runner.model.get_output_embeddings(), "include", None)
        if include is not None and new.numel():  # a shortlist head (--draft-vocab) learns the conversation's tokens
            include(new)
        self.checked = seq.shape[1]
        return seq.masked_fill(seq >= self.input_size, UNREADABLE_AS) if self.unreadable else seq

    def as_read(self, ids: list[int]) -> list[int]:
        """`ids` as `readable` shows them to the drafter, which its runner's cache kept from an earlier turn holds."""
        return [UNREADABLE_AS if i >= self.input_size else i for i in ids]

    @property
    def calls(self) -> int:
        return self.runner.calls

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        gamma = self.stop.length(gamma)
        if self.runner.limit is not None:
            gamma = min(gamma, self.runner.limit + 1 - seq.shape[1])
        self.runner.rollback_reserve = gamma  # a bounded cache keeps this round's drafts until they are verified
        seq = self.readable(seq)  # [1, L]; the drafts are the drafter's own ids, so they are the target's too
        length = seq.shape[1]
        support = self.support()
        qs = []
        with self.hidden_state_recorded():
            for index in range(1, max(gamma, 0) + 1):
                logits = self.align(self.runner.logits(seq, 1)[:, -1])  # [1, vocab]
                q = self.processor(logits)  # [1, vocab]
                x = self.processor.sample(q)  # [1]
                seq = torch.cat([seq, x.view(1, 1)], dim=1)
                qs.append(q)
                draft = Draft(index, logits, q, self.processor.is_greedy, self.hidden, support)
                if index < gamma and not self.stop.keep_going(draft):
                    break
        self.stop.drafted(len(qs))
        if not qs:
            return seq.new_zeros((1, 0)), None
        return seq[:, length:], torch.stack(qs, dim=1)  # [1, g], [1, g, vocab]

    def support(self) -> Tensor | None:
        """[n]: the ids a shortlist head computes (its logits are -inf elsewhere), within the target's vocabulary;
        None for a full head."""
        head = self.runner.model.get_output_embeddings()
        ids = getattr(head, "support", None)
        if ids is None or head.out_features <= self.target_vocab_size:
            return ids
        return ids[ids < self.target_vocab_size]  # `align` cuts the drafter's larger vocabulary

    @contextmanager
    def hidden_state_recorded(self):
        """Keeps the drafter's last hidden state in `self.hidden` while drafting, for rules that read it: the
        output layer's input, whatever the architecture (a hook, removed after the round: the model is shared)."""
        if not self.stop.needs_hidden:
            yield
            return

        def record(module, args):
            self.hidden = args[0][:, -1]  # [1, hidden]

        handle = self.runner.model.get_output_embeddings().register_forward_pre_hook(record)
        try:
            yield
        finally:
            handle.remove()

    def align(self, logits: Tensor) -> Tensor:
        """Expresses the drafter's logits over the target's vocabulary (padded vocabularies differ in size)."""
        extra = self.target_vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.target_vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def update_candidate_strategy(self, seq, num_accepted, num_drafted, target_logits) -> None:
        self.stop.update(num_accepted, num_drafted)
