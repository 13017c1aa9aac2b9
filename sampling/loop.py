"""The one speculative loop: draft, verify in one target pass, accept, repeat.

Autoregressive decoding is this loop with a drafter that drafts nothing; speculative decoding plugs in a
drafter model and NASD an n-gram storage.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from sampling.drafters import Drafter
from sampling.verification import accept_by_rejection, accept_by_sampling, unpack
from utils.arguments import count, flag
from utils.logits_processor import LogitsProcessor
from utils.model_runner import ModelRunner, check_prompt_fits

# eos_tokens_id's default: the end tokens the target names itself (its generation config's, else its config's).
# The first releases' default, id 1, is T5's end token but a word piece elsewhere ('"' in Qwen's vocabulary),
# where it cut answers short.
MODEL_EOS = "model"


@dataclass
class LoopSettings:
    max_gen_len: int = 40  # new tokens at most
    gamma: int = 5  # drafts per round at most
    # generation ends at the first of these (None: never early; MODEL_EOS: the target's own)
    eos_tokens_id: int | Iterable[int] | str | None = MODEL_EOS
    first_target: bool = True  # the first token comes from the target alone (prefill), before any drafting
    skip_sample_adjustment: bool = False  # sample from p instead of the residual after a rejection: NOT lossless

    def __post_init__(self):
        # Library callers pass numpy ints, tensors and sets; normalise once here so the loop sees one form.
        self.max_gen_len = count("max_gen_len", self.max_gen_len)
        self.gamma = count("gamma", self.gamma)
        self.first_target = flag("first_target", self.first_target)
        self.skip_sample_adjustment = flag("skip_sample_adjustment", self.skip_sample_adjustment)
        if not is_model_eos(self.eos_tokens_id):
            self.eos_tokens_id = stop_ids(self.eos_tokens_id)


def check_loop_args(processor, settings, drafts: bool = False) -> None:
    """The loop's processor and settings, checked where a generator starts: before it builds runners or counts
    a prompt into a storage. A loop that `drafts` needs a gamma of 1 or more (0 would silently be AR's)."""
    if not isinstance(settings, LoopSettings):
        raise ValueError(f"settings must be a LoopSettings, got {type(settings).__name__}")
    if drafts:
        drafting_gamma(settings.gamma)
    if not isinstance(processor, LogitsProcessor):
        raise ValueError("logits_processor must be a LogitsProcessor instance (e.g. GreedyProcessor() or "
                         f"NucleusProcessor(0.8, 0.9)), got {processor!r}")


def drafting_gamma(gamma) -> int:
    """A drafting generator's most drafts a round: an integer >= 1 (LoopSettings also takes AR's 0)."""
    return count("gamma", gamma, 1)


def is_model_eos(eos) -> bool:
    return isinstance(eos, str) and eos == MODEL_EOS


def model_eos(model: torch.nn.Module) -> tuple[int, ...]:
    """The end tokens `model` names: its generation config's, else its config's; none where it names none."""
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = stop_ids(getattr(config, "eos_token_id", None))
        if eos:
            return eos
    return ()


def stop_ids(eos, model: torch.nn.Module | None = None) -> tuple[int, ...]:
    """The end-token ids from an id, a list, tuple, set or integer tensor or array of ids, None (no end token),
    or MODEL_EOS (`model`'s own)."""
    if eos is None:
        return ()
    if is_model_eos(eos) and model is not None:
        return model_eos(model)
    given = eos
    if isinstance(eos, torch.Tensor) or type(eos).__module__ == "numpy" and getattr(eos, "ndim", 0) > 0:
        eos = eos.reshape(-1).tolist()
    elif not isinstance(eos, (list, tuple, set, frozenset, range)):
        eos = [eos]
    try:
        if any(isinstance(t, bool) for t in eos):
            raise TypeError
        return tuple(sorted({operator.index(t) for t in eos}))
    except TypeError:
        raise ValueError("eos_tokens_id must be a token id, a list, tuple, set or integer tensor of token ids, "
                         f"None (no end token) or MODEL_EOS (the model's own), got {given!r}") from None


@dataclass
class Round:
    """What one round did, for streaming and debug output."""

    drafts: list[int]  # what the drafter proposed, up to the answer's end
    accepted: int  # how many of them the target kept
    tokens: list[int]  # what this round appended to the output (accepted drafts + the target's token, cut at EOS)


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    drafter_calls: int = 0
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.no_grad()
def generate(
    target: ModelRunner,
    drafter: Drafter,
    prefix: list[int],
    processor: LogitsProcessor,
    settings: LoopSettings,
    on_round: Callable[[Round], None] | None = None,
) -> GenerationResult:
    """Extends `prefix` (the prompt, or the decoder start for encoder-decoders) and returns only the new tokens."""
    check_loop_args(processor, settings)
    if target.encoder_outputs is None:
        check_prompt_fits(len(prefix), target.limit)
        target.reuse(prefix)  # a runner kept from an earlier turn keeps what it shares with this prefix
    calls_before = (target.calls, drafter.calls)  # runners may be kept across generations
    stop = set(stop_ids(settings.eos_tokens_id, target.model))
    budget = settings.max_gen_len
    if target.limit is not None:
        # The last token is never fed back, so a sequence may end one past the context.
        budget = min(budget, target.limit + 1 - len(prefix))
    seq = torch.tensor([prefix], dtype=torch.long, device=target.device)  # [1, L]
    result = GenerationResult()
    while len(result.tokens) < budget:
        gamma = draft_length(settings, result, budget)
        drafts, q = drafter.get_candidates(seq, gamma) if gamma > 0 else (seq.new_zeros((1, 0)), None)
        g = drafts.shape[1]
        if g > gamma:  # past the budget or the context otherwise
            raise ValueError(f"the drafter proposed {g} drafts where at most {gamma} were asked")
        logits = target.logits(torch.cat([seq, drafts], dim=1), g + 1)  # [1, g+1, vocab]
        p = processor(logits)  # [1, g+1, vocab]
        # Greedy: the rejection test reduces to argmax matching (`accept_by_sampling`'s docstring), without the
        # residual's full-vocabulary arithmetic (0.2-0.4 ms against 0.9-1.0 for 3 drafts of a 152k vocabulary, Zen 3)
        if q is None or processor.is_greedy:
            packed = accept_by_sampling(p, drafts, processor)
        else:
            packed = accept_by_rejection(p, q.to(p.dtype), drafts, processor, adjust=not settings.skip_sample_adjustment)
        n, tokens = unpack(packed)
        tokens, done = cut_at_stop(tokens, stop)
        result.tokens += tokens
        # Drafts past the answer's end token are cut from the output: counted (and shown) neither as drafted nor
        # as kept.
        proposed, kept = (min(g, len(tokens)) if done else g), min(n, len(tokens))
        result.drafted += proposed
        result.accepted += kept
        result.rounds += 1
        seq = torch.cat([seq, torch.tensor([tokens], dtype=torch.long, device=seq.device)], dim=1)
        drafter.update_candidate_strategy(seq, n, g, logits)
        if on_round is not None:  # the drafts' copy waits on nothing: `unpack` has synced the round
            on_round(Round(drafts=drafts[0, :proposed].tolist(), accepted=kept, tokens=tokens))
        if done:
            break
    result.target_calls = target.calls - calls_before[0]
    result.drafter_calls = drafter.calls - calls_before[1]
    return result


def draft_length(settings: LoopSettings, result: GenerationResult, budget: int) -> int:
    if settings.first_target and result.rounds == 0:
        return 0
    # Never draft past the budget: the round's own token fills the last slot. The budget ends one past the
    # context, so a round's drafts and its token never outrun it either.
    return max(min(settings.gamma, budget - len(result.tokens) - 1), 0)


def cut_at_stop(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1], True
    return tokens, False
