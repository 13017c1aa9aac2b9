"""Logits processors: turn raw logits into the distribution we sample from.

The same processor is applied to the drafter's logits (q) and the target's logits (p), so speculative
decoding samples from exactly the distribution that plain decoding with this processor samples from.
Order of operations follows the usual convention: temperature, then top-k, then top-p.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import Tensor
from torch.nn import functional as F

from utils.arguments import count, real


# Logits are divided by T in float32: below 1e-6 a large logit nears float32's range (1e3 / 1e-36 is inf, and the
# softmax turns to nan), and above 1e6 every token is equally likely, so top-k would keep ties over the vocabulary.
TEMPERATURE_RANGE = (1e-6, 1e6)


class LogitsProcessor(abc.ABC):
    """Maps logits `[..., vocab]` to probabilities `[..., vocab]` and samples token ids from them."""

    def __init__(self, temperature: float = 1.0):
        low, high = TEMPERATURE_RANGE
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a number, got {temperature!r}") from None
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
        if not low <= temperature <= high:
            raise ValueError(f"temperature must be in [{low:g}, {high:g}] (the logits are float32), got {temperature:g}")
        self.temperature = temperature

    def __call__(self, logits: Tensor) -> Tensor:
        # Work in float32 at least: bfloat16 softmax over 150k entries loses the small probabilities.
        scaled = logits.float() / self.temperature if logits.dtype != torch.float64 else logits / self.temperature
        return F.softmax(self._filter(scaled), dim=-1)

    def _filter(self, logits: Tensor) -> Tensor:
        """Masks tokens out of the support; `logits` is already a fresh tensor we may own."""
        return logits

    def sample(self, probs: Tensor) -> Tensor:
        """`[..., vocab]` -> `[...]` token ids."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, num_samples=1).reshape(probs.shape[:-1])

    @property
    def is_greedy(self) -> bool:
        return False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


# Chunk of `first_argmax`'s first stage: 128 values, so a 152k vocabulary has ~1200 chunk maxima.
ARGMAX_CHUNK = 128


def first_argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)`, the same indices (the first maximum; the first NaN where there is one), in two stages:
    each chunk's maximum (`amax` is vectorised, `argmax` is not on CPU: 17-30 us against 176 us for a 152k row on
    the Zen 3 of benchmarks/RESULTS.md), the first chunk holding the row's maximum, then the first maximum in it.
    No host sync."""
    vocab = x.shape[-1]
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    if whole < 2 * ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x[..., :whole].unflatten(-1, (-1, ARGMAX_CHUNK))  # [..., n, chunk]
    maxima = chunks.amax(dim=-1)  # [..., n]
    if whole < vocab:
        maxima = torch.cat([maxima, x[..., whole:].amax(dim=-1, keepdim=True)], dim=-1)  # the tail as one more chunk
    chunk = maxima.argmax(dim=-1, keepdim=True)  # [..., 1]: the first chunk whose maximum is the row's
    at = chunk * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=x.device)  # [..., chunk]
    window = x.gather(-1, at.clamp_max(vocab - 1))  # the tail's last value repeated: after its first maximum
    return (chunk * ARGMAX_CHUNK + window.argmax(dim=-1, keepdim=True)).squeeze(-1)


class GreedyProcessor(LogitsProcessor):
    """Always the most probable token. Its distribution is one-hot, which makes rejection sampling exact argmax matching."""

    def __call__(self, logits: Tensor) -> Tensor:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        # written in place: F.one_hot makes int64 first, then a float copy (2.3x the time for one 152k row)
        probs = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        return probs.scatter_(-1, first_argmax(logits).unsqueeze(-1), 1.0)

    def sample(self, probs: Tensor) -> Tensor:
        return first_argmax(probs)

    @property
    def is_greedy(self) -> bool:
        return True


class MultinomialProcessor(LogitsProcessor):
    """Plain sampling from the softmax at the given temperature."""


class TopKProcessor(LogitsProcessor):
    """Sampling among the `top_k` most probable tokens."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50):
        super().__init__(temperature)
        self.top_k = checked_top_k(top_k)

    def _filter(self, logits: Tensor) -> Tensor:
        return top_k_filter(logits, self.top_k)


class NucleusProcessor(LogitsProcessor):
    """Sampling from the smallest set of tokens whose probability reaches `top_p`."""

    def __init__(self, temperature: float = 1.0, top_p: float = 0.9):
        super().__init__(temperature)
        self.top_p = checked_top_p(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return top_p_filter(logits, self.top_p)


class TopKNucleusProcessor(LogitsProcessor):
    """Top-k, then nucleus filtering."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9):
        super().__init__(temperature)
        self.top_k = checked_top_k(top_k)
        self.top_p = checked_top_p(top_p)

    def _filter(self, logits: Tensor) -> Tensor:
        return top_p_filter(top_k_filter(logits, self.top_k), self.top_p)


def checked_top_k(top_k) -> int:
    """`top_k` as an int >= 1; ValueError naming it otherwise: 2.7 is a mistake, not a request to round."""
    return count("top_k", top_k, low=1)


def checked_top_p(top_p) -> float:
    """`top_p` as a float in (0, 1]; ValueError naming it otherwise (None, a string, NaN)."""
    try:
        value = real("top_p", top_p)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    return value


def top_k_filter(logits: Tensor, top_k: int) -> Tensor:
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


# Candidates sorted first by the nucleus filter, 4x more until the nucleus ends among them. Sorting all 152k
# logits took 8.8 ms a row on the Xeon of benchmarks/RESULTS.md, a seventh of a decode step; the 64 first take
# 0.3 ms, and a peaked row's nucleus ends among them. A flat row costs at most 1.7x the full sort.
NUCLEUS_FIRST_K = 64


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Keeps, in order of probability, each token whose more probable tokens have less than `top_p` of the mass
    (so the most probable always stays). Row by row, so a row's result never depends on the rows beside it."""
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
    probs = F.softmax(flat, dim=-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    vocab = flat.shape[-1]
    for row in range(flat.shape[0]):
        k = min(NUCLEUS_FIRST_K, vocab)
        while True:
            index = torch.topk(flat[row], k).indices  # [k], most probable first
            p = probs[row, index]
            before = torch.cumsum(p, dim=0) - p  # mass of the more probable tokens
            if k == vocab or before[-1] >= top_p:  # one host sync per try: the k-th is out, so all later ones are
                break
            k = 4 * k if 4 * k <= vocab // 8 else vocab  # a flat row: sort it all
        kept = before < top_p  # [k]
        kept[0] = True  # a P that float32 rounds to 0 (1e-50) would keep nothing: the nucleus is never empty
        keep[row, index[kept]] = True
    return logits.masked_fill(~keep.view_as(logits), float("-inf"))
