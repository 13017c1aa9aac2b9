"""NASD: n-gram-assisted speculative decoding: the n-gram storages and their drafter, plugged into the one
speculative loop of `sampling`; imports `sampling` and the `utils` core only."""

from ngram_assisted.ngram_assisted import (
    PICKY,
    WIDE,
    NGramDraftPolicy,
    NGramDrafter,
    nasd_run,
    ngram_assisted_speculative_generate,
    policy_for,
)
from ngram_assisted.ngram_storage import NGramStorage, OneLevelNGramStorage

__all__ = ["PICKY", "WIDE", "NGramDraftPolicy", "NGramDrafter", "NGramStorage", "OneLevelNGramStorage", "nasd_run",
           "ngram_assisted_speculative_generate", "policy_for"]
