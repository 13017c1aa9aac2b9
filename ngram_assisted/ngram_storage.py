"""N-gram storages: the drafter of NASD, built from the prompt and the text generated so far.

A storage counts, for each context of the last k-1 tokens, which token followed it. `NGramStorage(n)` keeps
contexts of every length from 1 to n-1 and drafts from the longest one it has seen; `OneLevelNGramStorage(n)`
keeps contexts of length n-1 only. Counting is plain Python dictionaries: a prompt of a few thousand tokens
initialises in milliseconds, and drafting is a handful of dictionary look-ups per token.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from utils.arguments import count


# n bounds: contexts of 1 to 15 tokens. The storage grows with n for every token it counts, and a file or a
# command asking for millions would allocate that many tables before counting anything.
MIN_N, MAX_N = 2, 16


def n_of(n) -> int:
    """A storage's n, from MIN_N to MAX_N; ValueError naming the range otherwise."""
    try:
        value = count("n", n, low=MIN_N)
    except ValueError:
        value = None
    if value is None or value > MAX_N:
        raise ValueError(f"n must be an integer from {MIN_N} to {MAX_N}, got {n!r}")
    return value


def token_rows(name: str, ids, vocab_size: int) -> list[list[int]]:
    """Rows of token ids below `vocab_size` from a [batch, L] or [L] tensor (or nested lists); ValueError for any
    other shape or value: a 1-D row failed on `int` having no length, deep in the counting, and a negative or
    fractional id was counted, drafted, then refused by the embedding (or by the cache file, once saved)."""
    ids = torch.as_tensor(ids)
    if ids.ndim not in (1, 2) or (ids.numel() and (ids.is_floating_point() or ids.is_complex()
                                                   or ids.dtype == torch.bool)):
        raise ValueError(f"{name} must be token ids of shape [batch, L] or [L], got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
        raise ValueError(f"{name} must be token ids from 0 to {vocab_size - 1}, got {int(ids.min())}..{int(ids.max())}")
    return [ids.tolist()] if ids.ndim == 1 else ids.tolist()


class NGramCounts:
    """Counts for a set of context lengths, longest first."""

    def __init__(self, n: int, vocab_size: int, context_lengths: list[int]):
        self.n = n_of(n)
        self.vocab_size = count("vocab_size", vocab_size, low=1)
        self.context_lengths = context_lengths
        self.reset()

    def reset(self) -> None:
        # context length -> context -> {next token: count}, and the most frequent next token of each context
        self.counts: dict[int, dict[tuple, dict[int, int]]] = {k: defaultdict(dict) for k in self.context_lengths}
        self.best: dict[int, dict[tuple, int]] = {k: {} for k in self.context_lengths}

    def contexts(self) -> int:
        """How many contexts the storage knows, over all its lengths."""
        return sum(len(followers) for followers in self.counts.values())

    # -- list-based core ------------------------------------------------------------------------------------
    def add(self, history: list[int], next_tokens: list[int]) -> None:
        """Records that each of `next_tokens` followed `history` (one count each)."""
        if not next_tokens:  # else a context with no follower, no best one: a file its save could not write
            return
        for k in self.context_lengths:
            if len(history) < k:
                continue
            context = tuple(history[len(history) - k :])
            followers = self.counts[k][context]
            best = self.best[k]
            for token in next_tokens:
                count = followers.get(token, 0) + 1
                followers[token] = count
                if context not in best or count > followers[best[context]]:
                    best[context] = token

    def add_sequence(self, tokens: list[int]) -> None:
        rows = token_rows("tokens", tokens, self.vocab_size)
        if len(rows) != 1:
            raise ValueError(f"tokens must be one sequence of token ids, got {len(rows)} rows")
        tokens = rows[0]
        for i in range(1, len(tokens)):
            self.add(tokens[max(0, i - self.n + 1) : i], [tokens[i]])

    def lookup(self, history: list[int], min_context: int = 1) -> int | None:
        """The most frequent follower of the longest known context (of at least `min_context` tokens) ending
        `history`, or None."""
        for k in self.context_lengths:
            if len(history) >= k >= min_context:
                token = self.best[k].get(tuple(history[len(history) - k :]))
                if token is not None:
                    return token
        return None

    def draft(self, history: list[int], gamma: int, stop_if_unknown: bool = True, min_context: int = 1,
              prior: NGramCounts | None = None, prior_min_context: int = 1) -> list[int]:
        """Up to `gamma` tokens continuing `history`; at a context this storage does not know, the `prior`'s
        follower (contexts of at least `prior_min_context` tokens) if it knows one; else it stops, or repeats the
        last token."""
        history = list(history[-(self.n - 1) :])
        drafts: list[int] = []
        for _ in range(gamma):
            token = self.lookup(history, min_context)
            if token is None and prior is not None:
                token = prior.lookup(history, prior_min_context)
            if token is None:
                if stop_if_unknown or not history:
                    break
                token = history[-1]  # a guess; the target rejects it unless it agrees
            drafts.append(token)
            history = history[1:] + [token] if len(history) >= self.n - 1 else history + [token]
        return drafts

    # -- tensor API of the reference implementation ---------------------------------------------------------
    def initialize(self, input_ids: Tensor) -> None:
        """input_ids: [batch, L] (or one row, [L]): counts every k-gram of each row."""
        for row in token_rows("input_ids", input_ids, self.vocab_size):
            self.add_sequence(row)

    def update(self, input_ids: Tensor, next_tokens: Tensor) -> None:
        """input_ids: [batch, L] (or [L]); next_tokens: [batch, m] (or [batch]): each followed its row."""
        histories = token_rows("input_ids", input_ids, self.vocab_size)
        next_tokens = torch.as_tensor(next_tokens)
        followers = token_rows("next_tokens", next_tokens.reshape(-1) if next_tokens.ndim == 0 else next_tokens,
                               self.vocab_size)
        if len(followers) == 1 and len(histories) > 1:  # [batch]: one follower a row
            followers = [[token] for token in followers[0]]
        if len(followers) != len(histories):
            raise ValueError(f"next_tokens must have a row for each of the {len(histories)} rows of input_ids")
        for history, tokens in zip(histories, followers):
            self.add(history[-(self.n - 1) :], tokens)

    def next_token(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """input_ids: [batch, L] (or one row, [L]) -> (tokens [batch], known [batch]). Unknown rows get their last
        token."""
        tokens, known = [], []
        input_ids = torch.as_tensor(input_ids)
        for row in token_rows("input_ids", input_ids, self.vocab_size):
            token = self.lookup(row[-(self.n - 1) :])
            known.append(token is not None)
            tokens.append(token if token is not None else (row[-1] if row else 0))
        device = input_ids.device
        return torch.tensor(tokens, device=device), torch.tensor(known, dtype=torch.bool, device=device)

    def has_gram(self, ngram: Tensor) -> bool:
        """ngram: [k]: whether its last token was seen after its preceding tokens (for a stored context length)."""
        (tokens,) = token_rows("ngram", torch.as_tensor(ngram).reshape(-1), self.vocab_size)
        for k in self.context_lengths:
            if len(tokens) >= k + 1:
                followers = self.counts[k].get(tuple(tokens[-k - 1 : -1]))
                if followers and tokens[-1] in followers:
                    return True
        return False


class NGramStorage(NGramCounts):
    """k-grams for every k in [2, n]; drafts from the longest context seen."""

    def __init__(self, n: int, vocab_size: int):
        super().__init__(n, vocab_size, list(range(n_of(n) - 1, 0, -1)))


class OneLevelNGramStorage(NGramCounts):
    """n-grams only."""

    def __init__(self, n: int, vocab_size: int):
        super().__init__(n, vocab_size, [n_of(n) - 1])
