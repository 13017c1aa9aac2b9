"""NASD's prior: an n-gram storage of the target's own answers, shipped with the program. It drafts where the
prompt and the text so far know no context, as llama.cpp's static lookup cache does (that one counts a corpus;
this one counts what the target writes, so it knows its habits: "Certainly! Below is a Python function that").
Lossless as every draft is: it moves only how many of them the target keeps.

A prior is a file of `ngram_cache.py`'s format named after the fingerprint of the tokenizer whose ids it counts,
its GGUF padding entries left out (`prior_fingerprint`): a model with another tokenizer finds none, while the
same tokenizer read from a GGUF file or from its original, for a model whose embedding has more rows, finds it.
`python -m benchmarks.ngram_prior build` makes it and records where it came from (prompts, length, commit).
"""

from __future__ import annotations

from pathlib import Path

from ngram_assisted.ngram_cache import load_storage, unpadded_fingerprint
from ngram_assisted.ngram_storage import NGramCounts
from utils.models.tokenizer_cache import derived

PRIORS = Path(__file__).parent / "priors"


def prior_fingerprint(tokenizer) -> str:
    """The fingerprint a prior for `tokenizer` is named after; read back from a prepared folder's facts where
    there are (`derived`: the scan over 150k tokens took ~1 s a start on the Zen 3)."""
    return derived(tokenizer, unpadded_fingerprint)


def prior_path(fingerprint: str) -> Path:
    return PRIORS / f"{fingerprint}.json.gz"


def shipped_prior(fingerprint: str, vocab_size: int) -> NGramCounts | None:
    """The prior shipped for this tokenizer, for a model of `vocab_size` outputs, or None; NGramCacheError (one
    line) for a file that cannot be used."""
    path = prior_path(fingerprint)
    return load_storage(path, fingerprint, vocab_size, padded=True) if path.exists() else None
