"""An n-gram storage saved to a file and loaded back, as llama.cpp's lookup keeps its dynamic n-gram cache: NASD
then starts a prompt knowing the text of earlier prompts and sessions.

The file is gzip-compressed JSON that names its format, the storage's kind and n, and a fingerprint of the
tokenizer whose ids it counts: ids mean nothing under another tokenizer, so a foreign file is refused.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

from ngram_assisted.ngram_storage import NGramCounts, NGramStorage, OneLevelNGramStorage

FORMAT = "specdec-ngram-cache"
VERSION = 1
KINDS = {"basic": NGramStorage, "onelevel": OneLevelNGramStorage}


class NGramCacheError(Exception):
    """The file cannot be used; the message is one line meant for the user."""


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies the id -> string mapping the counts are in (not the tokenizer's name: a renamed copy is fine)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def kind_of(storage: NGramCounts) -> str:
    return next(name for name, cls in KINDS.items() if type(storage) is cls)


def save_storage(path: str | Path, storage: NGramCounts, fingerprint: str) -> None:
    """Writes the storage next to `path` and renames it into place: a crash leaves the old file whole."""
    path = Path(path)
    state = {
        "format": FORMAT, "version": VERSION, "kind": kind_of(storage), "n": storage.n,
        "vocab_size": storage.vocab_size, "tokenizer": fingerprint,
        # per context length: [context, [[next token, count], ...] in insertion order, most frequent next token]
        "contexts": {str(k): [[list(context), list(followers.items()), storage.best[k][context]]
                              for context, followers in storage.counts[k].items()]
                     for k in storage.context_lengths},
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            json.dump(state, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise NGramCacheError(f"cannot write the n-gram cache {path}: {error.strerror or error}") from None


def load_storage(path: str | Path, fingerprint: str, vocab_size: int) -> NGramCounts:
    """The storage saved in `path`; NGramCacheError when it is unreadable, corrupt or from another tokenizer."""
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            state = json.load(f)
    except OSError as error:  # missing, unreadable, or not gzip
        raise NGramCacheError(f"cannot read the n-gram cache {path}: {error.strerror or error}") from None
    except (ValueError, EOFError) as error:
        raise NGramCacheError(f"the n-gram cache {path} is corrupt ({type(error).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise NGramCacheError(f"{path} is not an n-gram cache of this program")
    if state.get("version") != VERSION:
        raise NGramCacheError(f"the n-gram cache {path} has version {state.get('version')}, this program reads {VERSION}")
    if state.get("tokenizer") != fingerprint or state.get("vocab_size") != vocab_size:
        raise NGramCacheError(f"the n-gram cache {path} was made with another tokenizer; its ids would mean other text")
    try:
        storage = KINDS[state["kind"]](state["n"], vocab_size)
        for k in storage.context_lengths:
            for context, followers, best in state["contexts"][str(k)]:
                context = tuple(int(t) for t in context)
                if len(context) != k:
                    raise ValueError
                storage.counts[k][context] = {int(t): int(c) for t, c in followers}
                storage.best[k][context] = int(best)
    except (KeyError, TypeError, ValueError):
        raise NGramCacheError(f"the n-gram cache {path} is corrupt (bad contents)") from None
    return storage
