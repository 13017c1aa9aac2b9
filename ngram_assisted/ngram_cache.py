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
import zlib
from pathlib import Path

from ngram_assisted.ngram_storage import MAX_N, MIN_N, NGramCounts, NGramStorage, OneLevelNGramStorage
from utils.models.vocab_check import PADDING

FORMAT = "specdec-ngram-cache"
VERSION = 1
KINDS = {"basic": NGramStorage, "onelevel": OneLevelNGramStorage}
# Inflated JSON read at most: as dictionaries it takes some twenty times as much memory. At the default n = 4 a
# storage reaches it after about a million tokens; save_storage writes no more, so what it writes loads back.
MAX_BYTES = 64 << 20


class NGramCacheError(Exception):
    """The file cannot be used; the message is one line meant for the user."""




def tokenizer_fingerprint(tokenizer, padding: bool = True) -> str:
    """Identifies the id -> string mapping the counts are in (not the tokenizer's name: a renamed copy is fine).
    Without `padding`, the GGUF converter's padding entries are left out, so a tokenizer read from a GGUF file
    and its original (Qwen2.5: 151936 entries against 151665) share one fingerprint, as they share every id text
    can give."""
    vocab = sorted(((text, i) for text, i in tokenizer.get_vocab().items() if padding or not PADDING.fullmatch(text)),
                   key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def unpadded_fingerprint(tokenizer) -> str:
    """`tokenizer_fingerprint` without the GGUF padding entries (what a shipped prior is named after)."""
    return tokenizer_fingerprint(tokenizer, padding=False)


def kind_of(storage: NGramCounts) -> str:
    for name, cls in KINDS.items():
        if type(storage) is cls:
            return name
    raise ValueError(f"a storage to save must be one of {', '.join(c.__name__ for c in KINDS.values())}, "
                     f"got {type(storage).__name__}")


def save_storage(path: str | Path, storage: NGramCounts, fingerprint: str, about: dict | None = None) -> None:
    """Writes the storage next to `path` and renames it into place: a crash leaves the old file whole. A symbolic
    link is written through: the file it points to is replaced, the link kept (a cache kept on another disk).
    `about`: where the counts came from, kept in the file and not read back (a shipped prior's provenance)."""
    path = Path(os.path.realpath(path))
    state = {
        **({"about": about} if about else {}),
        "format": FORMAT, "version": VERSION, "kind": kind_of(storage), "n": storage.n,
        "vocab_size": storage.vocab_size, "tokenizer": fingerprint,
        # per context length: [context, [[next token, count], ...] in insertion order, most frequent next token]
        "contexts": {str(k): [[list(context), list(followers.items()), storage.best[k][context]]
                              for context, followers in storage.counts[k].items()]
                     for k in storage.context_lengths},
    }
    data = json.dumps(state, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_BYTES:
        raise NGramCacheError(f"the n-gram storage has outgrown {MAX_BYTES >> 20} MB and is no longer saved to {path}; "
                              "/set_ngramstorage with a smaller n, or another file, starts afresh")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb") as f:
                f.write(data)
            raw.flush()
            os.fsync(raw.fileno())  # on the disk before the rename: a power cut leaves the old file, not an empty one
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise NGramCacheError(f"cannot write the n-gram cache {path}: {error.strerror or error}") from None
    except BaseException:  # SIGTERM's SystemExit or Ctrl-C mid-write: the old file is whole, the half one goes
        tmp.unlink(missing_ok=True)
        raise


def load_storage(path: str | Path, fingerprint: str, vocab_size: int, padded: bool = False) -> NGramCounts:
    """The storage saved in `path`; NGramCacheError when it is unreadable, corrupt, from another tokenizer, or
    claims more than a storage of this program holds. Everything is bounded before anything is built: the bytes
    inflated, n, and every id (a crafted file once took 8.7 GB through n alone, and a KeyError from a `best` id
    that is no follower ended a run). `padded`: the model's vocabulary may be larger than the file's, as models
    of one tokenizer pad their embeddings to different sizes (Qwen2.5: 151936 rows at 1.5B, 152064 at 7B)."""
    path = Path(path)
    state = read_state(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise NGramCacheError(f"{path} is not an n-gram cache of this program")
    if state.get("version") != VERSION:
        raise NGramCacheError(f"the n-gram cache {path} has version {state.get('version')}, this program reads {VERSION}")
    file_vocab = state.get("vocab_size")
    if state.get("tokenizer") != fingerprint or not (file_vocab == vocab_size or padded and is_int(file_vocab)
                                                     and file_vocab <= vocab_size):
        raise NGramCacheError(f"the n-gram cache {path} was made with another tokenizer; its ids would mean other text")
    n = state.get("n")
    if not is_int(n) or not MIN_N <= n <= MAX_N:
        raise NGramCacheError(f"the n-gram cache {path} is corrupt (n = {str(n)[:20]}; n runs from {MIN_N} to {MAX_N})")
    try:
        storage = KINDS[state["kind"]](n, vocab_size)
        for k in storage.context_lengths:
            for context, followers, best in state["contexts"][str(k)]:
                context = tuple(token_id(t, file_vocab) for t in context)  # ids of the file's own vocabulary
                counts = {token_id(t, file_vocab): count(c) for t, c in followers}
                if len(context) != k or token_id(best, file_vocab) not in counts:
                    raise ValueError
                storage.counts[k][context] = counts
                storage.best[k][context] = best
    except (KeyError, TypeError, ValueError):
        raise NGramCacheError(f"the n-gram cache {path} is corrupt (bad contents)") from None
    return storage


def read_state(path: Path):
    """The file's JSON, inflating at most MAX_BYTES: a small gzip can inflate to gigabytes."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as error:  # missing, unreadable, or not gzip
        raise NGramCacheError(f"cannot read the n-gram cache {path}: {error.strerror or error}") from None
    except (EOFError, zlib.error) as error:  # cut short, or a damaged deflate stream behind a valid header
        raise NGramCacheError(f"the n-gram cache {path} is corrupt ({type(error).__name__})") from None
    if len(data) > MAX_BYTES:
        raise NGramCacheError(f"the n-gram cache {path} inflates to more than {MAX_BYTES >> 20} MB, more than a "
                              "storage of this program writes")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise NGramCacheError(f"the n-gram cache {path} is corrupt ({type(error).__name__})") from None


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_id(value, vocab_size: int) -> int:
    if not is_int(value) or not 0 <= value < vocab_size:
        raise ValueError
    return value


def count(value) -> int:
    if not is_int(value) or value < 1:
        raise ValueError
    return value
