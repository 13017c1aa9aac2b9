"""A drafter model with its own tokenizer: its drafts are translated into the target's tokens through text.

This is SLEM, string-level exact match (Timor et al. 2025, "Accelerating LLM Inference with Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies"), the scheme of transformers' universal assisted
generation. Each round:

1. the target's sequence is decoded to text and re-tokenised by the drafter's tokenizer (`translated_ids`:
   control tokens as control tokens, text as text, so a control token's string typed in a message stays text for
   the drafter as it did for the target); the drafter's runner
   keeps the KV entries of the prefix it shares with what it held (`ModelRunner.reuse`), so after a partial
   acceptance its cache is rolled back or extended to match the accepted text, with the cache on or off;
2. the drafter proposes `gamma` tokens of its own, which are decoded to text and tokenised by the target's
   tokenizer after the text so far: those target tokens are the drafts, at most `gamma`;
3. the loop verifies them as deterministic proposals (`accept_by_sampling`): each position's token is drawn
   from the target's own distribution `p`, and a draft is kept only while it equals that draw.

Why it is exact, for greedy and sampled decoding alike: every emitted token is a draw from the target's `p` at
its position (or its argmax); the drafts decide only how many positions one target pass settles. No drafter
probability enters the rule, so no vocabulary mapping has to be right for the output to be right; a poor
translation costs speed, never correctness. (TLI, the paper's rejection sampling over the vocabularies'
intersection, accepts more under sampling, but needs the drafter's distribution mapped into the target's ids.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.draft_stop import AdaptiveLength
from utils.logits_processor import LogitsProcessor
from utils.model_runner import ModelRunner, common_prefix_length


def same_vocabulary(tokenizer_a, tokenizer_b) -> bool:
    """Whether two tokenizers map the same strings to the same ids (then drafts need no translation). Sizes
    first: building a 150k-entry vocabulary costs ~0.1 s, and this runs at the start of each generation."""
    if tokenizer_a is tokenizer_b:
        return True
    return len(tokenizer_a) == len(tokenizer_b) and tokenizer_a.get_vocab() == tokenizer_b.get_vocab()


def control_tokens(tokenizer) -> dict[int, str]:
    """id -> string of the tokens the tokenizer reads as control tokens (a chat template's, the end of a text);
    none where the tokenizer cannot list them."""
    try:
        return {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    except (AttributeError, NotImplementedError):
        return {}


def translated_ids(ids: list[int], source, destination, controls: dict[int, str] | None = None,
                   theirs: set[str] | None = None, text: str | None = None) -> list[int]:
    """`ids` of the `source` tokenizer as `destination` reads them. `controls`: the source's control tokens,
    `theirs`: the destination's control strings, `text`: `ids` decoded, where the caller has them.

    Usually the whole text in one call, control strings read as the destination's control tokens. Where the text
    holds more of the destination's control strings than the control tokens among `ids` account for (a user typed
    one, which the target read as text), the pieces between control tokens are read as text and each control token
    by its string; unless decoding piece by piece does not give the text back (a tokenizer that reads the start of
    a piece otherwise) or the destination cannot split control strings: then the whole text again. Drafts only,
    never the output, depend on it."""
    controls = control_tokens(source) if controls is None else controls
    theirs = set(control_tokens(destination).values()) if theirs is None else theirs
    text = source.decode(ids) if text is None else text
    whole = lambda: list(destination(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    typed = sum(text.count(c) for c in theirs) - sum(1 for token in ids if controls.get(token) in theirs)
    if typed <= 0:
        return whole()
    pieces, start = [], 0  # (ids, is a control token)
    for i, token in enumerate(ids):
        if token in controls:
            pieces += [(ids[start:i], False)] if start < i else []
            pieces.append((ids[i : i + 1], True))
            start = i + 1
    pieces += [(ids[start:], False)] if start < len(ids) else []
    decoded = [source.decode(piece) for piece, _ in pieces]
    if "".join(decoded) != text:
        return whole()
    out: list[int] = []
    try:
        for (_, control), piece_text in zip(pieces, decoded):
            out += destination(piece_text, add_special_tokens=False, split_special_tokens=not control)["input_ids"]
    except (TypeError, ValueError, NotImplementedError):  # a backend without split_special_tokens
        return whole()
    return out


class TranslatingDrafter:
    def __init__(self, runner: ModelRunner, processor: LogitsProcessor, target_tokenizer, drafter_tokenizer,
                 target_vocab_size: int, schedule: AdaptiveLength | None = None):
        self.runner = runner
        self.schedule = schedule  # a length that follows acceptance (its drafts are text: no distribution to read)
        self.target_vocab_size = target_vocab_size  # a tokenizer's added tokens may lie past the model's rows
        self.processor = processor
        self.target_tokenizer, self.drafter_tokenizer = target_tokenizer, drafter_tokenizer
        # looked up once: a round translates the whole sequence
        self.controls = control_tokens(target_tokenizer)
        self.drafter_controls = set(control_tokens(drafter_tokenizer).values())

    @property
    def calls(self) -> int:
        return self.runner.calls

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, None]:
        ids = seq[0].tolist()
        text = self.target_tokenizer.decode(ids)  # special tokens kept: the drafter reads them too
        try:
            own = self.drafter_ids(ids, text)
        except Exception:  # text the drafter's tokenizer cannot encode (no unknown token): the target goes alone
            return seq.new_zeros((1, 0)), None
        if self.schedule is not None:
            gamma = self.schedule.next(gamma)
        if self.runner.limit is not None:
            gamma = min(gamma, self.runner.limit + 1 - len(own))
        proposed = self.draft(own, gamma)
        # Decoded after its context, so that the boundary's space (or its absence) comes out right.
        draft_text = self.drafter_tokenizer.decode(own + proposed)[len(self.drafter_tokenizer.decode(own)) :]
        drafts = self.target_continuation(text, draft_text)[:gamma]
        unreadable = next((i for i, t in enumerate(drafts) if t >= self.target_vocab_size), len(drafts))
        drafts = drafts[:unreadable]
        return torch.tensor([drafts], dtype=torch.long, device=seq.device).view(1, -1), None

    def drafter_ids(self, ids: list[int], text: str) -> list[int]:
        own = translated_ids(ids, self.target_tokenizer, self.drafter_tokenizer, self.controls, self.drafter_controls,
                             text)
        return own or [self.drafter_tokenizer.bos_token_id or 0]

    def draft(self, own: list[int], gamma: int) -> list[int]:
        """`gamma` tokens of the drafter's own, after `own`; its cache keeps what it shares with the last round."""
        if gamma <= 0:
            return []
        self.runner.rollback_reserve = gamma  # a bounded cache keeps this round's drafts until the next reuse
        self.runner.reuse(own)
        seq = torch.tensor([own], dtype=torch.long, device=self.runner.device)  # [1, L]
        for _ in range(gamma):
            q = self.processor(self.runner.logits(seq, 1)[:, -1])  # [1, drafter vocab]
            seq = torch.cat([seq, self.processor.sample(q).view(1, 1)], dim=1)
        return seq[0, len(own) :].tolist()

    def target_continuation(self, text: str, draft_text: str) -> list[int]:
        """The target's tokens for `draft_text` following `text`: the tokenisation of the whole past the part it
        shares with the tokenisation of `text` alone (a word cut by the round boundary re-merges this way)."""
        if not draft_text:
            return []
        before = self.target_tokenizer(text, add_special_tokens=False)["input_ids"]
        after = self.target_tokenizer(text + draft_text, add_special_tokens=False)["input_ids"]
        common = common_prefix_length(before, after)
        return after[common:] if common == len(before) else []  # the boundary token changed: nothing to propose

    def update_candidate_strategy(self, seq, num_accepted, num_drafted, target_logits) -> None:
        if self.schedule is not None:
            self.schedule.update(num_accepted, num_drafted)
