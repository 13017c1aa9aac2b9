"""NASD: speculative decoding whose drafter is an n-gram storage of the prompt and the text so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ngram_assisted.ngram_storage import NGramCounts
from sampling.draft_stop import AdaptiveLength
from sampling.drafters import DoublingLength
from sampling.loop import (MODEL_EOS, GenerationResult, LoopSettings, Round, check_loop_args, drafting_gamma,
                           generate)
from utils.logits_processor import GreedyProcessor, LogitsProcessor
from utils.arguments import count, flag, tokenizer_like
from utils.model_runner import ModelRunner, check_prompt_fits, check_runner, token_ids
from utils.printing import debug_printer


@dataclass
class NGramDraftPolicy:
    """When and how much the n-gram drafter drafts. Every drafted token widens the verification pass, which
    costs even when the draft is rejected, so a draft must be likely to pay (see the benchmark in the README)."""

    stop_if_unknown: bool = True  # stop at the first unknown context instead of guessing
    min_context: int = 1  # draft only from contexts of at least this many tokens (1 drafts from any bigram)
    length: str = "fixed"  # "fixed": gamma each round; "follow": +2 after a fully accepted round, -1 after a
    # rejection (AdaptiveLength); "double": 3 after a rejection, x2 after full acceptance (DoublingLength)
    prior_min_context: int = 1  # a prior (ngram_prior.py) drafts where the storage has no context, from contexts
    # of at least this many tokens (at most the storage's n-1: the drafter lowers it to that)

    def __post_init__(self):
        self.min_context = count("min_context", self.min_context, low=1)
        self.prior_min_context = count("prior_min_context", self.prior_min_context, low=1)
        self.stop_if_unknown = flag("stop_if_unknown", self.stop_if_unknown)
        if not isinstance(self.length, str) or self.length not in LENGTHS:
            raise ValueError(f"length must be one of {', '.join(LENGTHS)}, got {self.length!r}")


LENGTHS = {"fixed": None, "follow": AdaptiveLength, "double": DoublingLength}
# Cache on (the CLI and the benchmark): a draft widens a one-row pass, so contexts of 2+ tokens, the prior's too
# (prior contexts of 3 only: 0.85 / 0.93 / 0.98x NASD's time against 0.82 / 0.92 / 0.96x; twenty-seventh pass).
PICKY = NGramDraftPolicy(stop_if_unknown=True, min_context=2, length="double", prior_min_context=2)
# Cache off, every pass feeds the whole sequence (40-90 rows in the default chat), so a draft adds one row to it
# and a rejected one costs ~2% of a pass: drafting from bigram contexts too pays there (1.5B, 35 tokens, gamma 6:
# code-editing 10% fewer target passes and 10% less time, code-writing and chat 1.5%; twenty-fourth pass,
# benchmarks/RESULTS.md). Guessing at unknown contexts did not: the same passes, wider. The prior's contexts of
# 1+ tokens did (0.77 / 0.82 / 0.93x NASD's time held out, the default chat's NASD 34 -> 22 passes; twenty-seventh).
WIDE = NGramDraftPolicy(stop_if_unknown=True, min_context=1, length="double")
REFERENCE = NGramDraftPolicy(stop_if_unknown=False)  # the reference implementation: any context, guesses, fixed gamma


def policy_for(use_cache: bool) -> NGramDraftPolicy:
    """The policy NASD drafts under by default: PICKY with the cache on, WIDE with it off."""
    return PICKY if use_cache else WIDE


class NGramDrafter:
    """Drafts from an n-gram storage, and learns each verified position's token (plus the target's top-k)."""

    calls = 0  # no model forwards

    def __init__(self, storage: NGramCounts, prompt_len: int, filler_top_k: int = 3,
                 policy: NGramDraftPolicy = NGramDraftPolicy(), prior: NGramCounts | None = None,
                 vocab_size: int | None = None):
        self.storage = storage
        self.vocab_size = vocab_size  # the target's: a storage filled by hand may hold ids past it
        self.prior = prior  # read-only: what the target tends to write (ngram_prior.py); never learns
        self.length = prompt_len  # tokens already counted
        self.filler_top_k = count("filler_top_k", filler_top_k)
        self.policy = policy
        # a storage of n-grams holds contexts of at most n-1 tokens: a policy asking for longer ones (PICKY's 2
        # with a bigram storage) would never draft, so it drafts from the longest the storage has
        self.min_context = min(policy.min_context, storage.n - 1)
        self.prior_min_context = min(policy.prior_min_context, storage.n - 1)
        schedule = LENGTHS[policy.length]
        self.adaptive = schedule() if schedule is not None else None

    def get_candidates(self, seq: Tensor, gamma: int) -> tuple[Tensor, Tensor | None]:
        if self.adaptive is not None:
            gamma = self.adaptive.next(gamma)
        history = seq[0, -(self.storage.n - 1) :].tolist()  # a sync: the storage is Python dictionaries of ids
        drafts = self.storage.draft(history, gamma, self.policy.stop_if_unknown, self.min_context,
                                    self.prior, self.prior_min_context)
        if self.vocab_size is not None and drafts and max(drafts) >= self.vocab_size:
            drafts = drafts[: next(i for i, t in enumerate(drafts) if t >= self.vocab_size)]  # never acceptable
        return torch.tensor([drafts], dtype=torch.long, device=seq.device).view(1, -1), None

    def update_candidate_strategy(self, seq: Tensor, num_accepted: int, num_drafted: int, target_logits: Tensor) -> None:
        if self.adaptive is not None:
            self.adaptive.update(num_accepted, num_drafted)
        self.learn(seq, target_logits)

    def learn(self, seq: Tensor, target_logits: Tensor) -> None:
        new = seq.shape[1] - self.length
        window = seq[0, max(0, self.length - self.storage.n + 1) :].tolist()  # a sync, as in get_candidates
        offset = len(window) - new
        fillers = self.fillers(target_logits, new)
        for i in range(new):
            history = window[: offset + i]
            self.storage.add(history[-(self.storage.n - 1) :], [window[offset + i]] + fillers[i])
        self.length = seq.shape[1]

    def fillers(self, target_logits: Tensor, new: int) -> list[list[int]]:
        if self.filler_top_k <= 1:
            return [[] for _ in range(new)]
        k = min(self.filler_top_k, target_logits.shape[-1])
        return torch.topk(target_logits[0, :new], k, dim=-1).indices.tolist()  # [new, k]; a sync, for the storage


def nasd_run(
    inputs: list[int],
    ngramstorage: NGramCounts,
    target: torch.nn.Module,
    logits_processor: LogitsProcessor | None = None,
    settings: LoopSettings | None = None,
    filler_top_k: int = 3,
    use_cache: bool = False,
    policy: NGramDraftPolicy | None = None,
    on_round: Callable[[Round], None] | None = None,
    runner: ModelRunner | None = None,
    prior: NGramCounts | None = None,
) -> GenerationResult:
    """NASD with full statistics. The storage is filled from the prompt first (it is not reset here). A
    `runner` of `target` kept from an earlier call reuses its KV cache for the prefix it shares with `inputs`.
    `policy`: `policy_for(use_cache)` (a `runner`'s cache, if given) unless given. A `prior` storage drafts where
    the storage knows no context."""
    settings = settings if settings is not None else LoopSettings()
    processor = logits_processor if logits_processor is not None else GreedyProcessor()
    check_loop_args(processor, settings, drafts=True)
    runner = check_runner(runner, target, "target") if runner is not None else None
    # a kept runner's cache decides the passes' cost, so the policy follows it
    policy = policy if policy is not None else policy_for(runner.use_cache if runner is not None else use_cache)
    if not isinstance(policy, NGramDraftPolicy):
        raise ValueError(f"policy must be an NGramDraftPolicy (e.g. PICKY or WIDE) or None, got {policy!r}")
    if not isinstance(ngramstorage, NGramCounts):
        raise ValueError(f"ngramstorage must be an n-gram storage (NGramStorage(n, vocab_size)), got {ngramstorage!r}")
    if prior is not None and not isinstance(prior, NGramCounts):
        raise ValueError(f"prior must be an n-gram storage or None, got {prior!r}")
    inputs = token_ids(inputs, target)  # before the storage counts them
    runner = runner if runner is not None else ModelRunner(target, use_cache=use_cache)
    if ngramstorage.vocab_size < runner.vocab_size:  # it would learn the target's tokens past its own ids, and
        # save a file it then refuses to load
        raise ValueError(f"ngramstorage holds ids below {ngramstorage.vocab_size}, the target outputs "
                         f"{runner.vocab_size}: size it by the target's (target.config.vocab_size)")
    drafter = NGramDrafter(ngramstorage, len(inputs), filler_top_k, policy, prior, runner.vocab_size)
    check_prompt_fits(len(inputs), runner.limit)  # `generate` checks it too, after the storage would have counted it
    ngramstorage.add_sequence(inputs)  # after the checks: a refused call leaves the storage as it was
    return generate(runner, drafter, inputs, processor, settings, on_round)


def ngram_assisted_speculative_generate(
    inputs: list[int],
    ngramstorage: NGramCounts,
    target: torch.nn.Module,
    tokenizer=None,
    gamma: int = 5,
    filler_top_k: int = 3,
    logits_processor: LogitsProcessor | None = None,
    max_gen_len: int = 40,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,
    use_cache: bool = False,
    first_target: bool = True,
    stop_if_unknown: bool = False,
    debug: bool = False,
) -> tuple[list[int], float]:
    """Returns the new tokens and the acceptance rate. With `stop_if_unknown`, drafting stops at the first
    context the storage has never seen; without it, the draft goes on with a guess (the last token)."""
    settings = LoopSettings(max_gen_len, drafting_gamma(gamma), eos_tokens_id, first_target)
    on_round = debug_printer(tokenizer_like("tokenizer", tokenizer)) if flag("debug", debug) else None
    policy = NGramDraftPolicy(stop_if_unknown=stop_if_unknown)  # REFERENCE, unless told to stop at unknown contexts
    result = nasd_run(inputs, ngramstorage, target, logits_processor, settings, filler_top_k, use_cache, policy, on_round)
    return result.tokens, result.acceptance_rate
