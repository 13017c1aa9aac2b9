"""Beam search for decoder-only models, ranked under the GNMT length penalty.

A hypothesis' score is its summed log-probability divided by ((min_length + len) / (min_length + 1)) ** alpha.
Each step expands every open beam by its `top_k` best tokens; finished beams (ended by an end token) compete
with the open ones at every step; the search ends when the `num_beams` best are all finished or the length
budget is spent. The cache is not used: beams are re-scored in one batched forward per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from sampling.loop import MODEL_EOS, stop_ids
from utils.arguments import count, flag, tokenizer_like
from utils.model_runner import check_eval, check_prompt_fits, context_limit, keeps_logits, token_ids


@dataclass
class Beam:
    tokens: list[int]
    logprob: float
    finished: bool

    def score(self, min_length: float, alpha: float) -> float:
        return self.logprob / length_penalty(len(self.tokens), min_length, alpha)


def length_penalty(length: int, min_length: float, alpha: float) -> float:
    return ((min_length + length) / (min_length + 1)) ** alpha


@torch.no_grad()
def beam_search_generate(
    inputs: list[int],
    model: torch.nn.Module,
    max_gen_len: int = 40,
    num_beams: int = 4,
    top_k: int = 3,
    min_length: float = 5.0,
    alpha: float = 1.2,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,
    debug: bool = False,
    tokenizer=None,
) -> list[int]:
    """Returns the new tokens of the highest-scoring beam."""
    max_gen_len = count("max_gen_len", max_gen_len)
    debug, tokenizer = flag("debug", debug), tokenizer_like("tokenizer", tokenizer)
    num_beams, top_k = count("num_beams", num_beams, low=1), count("top_k", top_k, low=1)
    if not (isinstance(min_length, (int, float)) and math.isfinite(min_length) and min_length >= 0):
        raise ValueError(f"min_length must be a finite number >= 0, got {min_length!r}")  # the penalty divides by it + 1
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("beam search takes decoder-only models; for an encoder-decoder model use "
                         "autoregressive_generate_encoder_decoder or speculative_generate_encoder_decoder")
    check_eval(model)
    inputs = token_ids(inputs, model)
    limit = context_limit(model)
    check_prompt_fits(len(inputs), limit)
    if limit is not None:
        max_gen_len = min(max_gen_len, limit + 1 - len(inputs))
    stop = set(stop_ids(eos_tokens_id, model))
    beams = [Beam([], 0.0, False)]
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}  # the head over the last position only
    for _ in range(max_gen_len):
        open_beams = [b for b in beams if not b.finished]
        if not open_beams:
            break
        ids = torch.tensor([list(inputs) + b.tokens for b in open_beams], device=model.device)  # [beams, L]
        logprobs = F.log_softmax(model(input_ids=ids, **keep).logits[:, -1].float(), dim=-1)  # [beams, vocab]
        top = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
        candidates = [b for b in beams if b.finished]
        for beam, values, tokens in zip(open_beams, top.values.tolist(), top.indices.tolist()):
            for value, token in zip(values, tokens):
                candidates.append(Beam(beam.tokens + [token], beam.logprob + value, token in stop))
        candidates.sort(key=lambda b: b.score(min_length, alpha), reverse=True)
        beams = candidates[:num_beams]
        if debug:
            best = beams[0]
            text = tokenizer.decode(best.tokens) if tokenizer is not None else best.tokens
            print(f"beam search: best {best.score(min_length, alpha):.3f} {text!r}")
    return beams[0].tokens
