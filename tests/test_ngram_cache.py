"""The n-gram cache file: a saved storage loads back the same, and a corrupt or foreign file is one line."""

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from cli_models import WORDS, write_tiny_model
from ngram_assisted import NGramStorage, OneLevelNGramStorage
from ngram_assisted.ngram_cache import NGramCacheError, load_storage, save_storage

TOKENS = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6, 7, 5, 6, 8, 8, 8]


@pytest.mark.parametrize("cls, n", [(NGramStorage, 4), (OneLevelNGramStorage, 3), (NGramStorage, 2),
                                    (OneLevelNGramStorage, 16)])  # n's bounds: a storage of any n loads back
def test_round_trip_keeps_counts_and_drafts(tmp_path, cls, n):
    storage = cls(n, 64)
    storage.add_sequence(TOKENS)
    storage.add([5, 6], [9, 9, 9])  # a later majority changes the best follower
    save_storage(tmp_path / "c.ngram", storage, "fp")
    loaded = load_storage(tmp_path / "c.ngram", "fp", 64)
    assert type(loaded) is cls and loaded.n == n
    assert loaded.counts == storage.counts and loaded.best == storage.best
    for start in range(len(TOKENS)):
        assert loaded.draft(TOKENS[:start], 5) == storage.draft(TOKENS[:start], 5)


def write_gzip_json(path, value):
    with gzip.open(path, "wt") as f:
        json.dump(value, f)


def test_a_storage_of_another_class_is_refused_by_name(tmp_path):
    class Mine(NGramStorage):  # StopIteration, from a lookup of the classes a file can name
        pass

    with pytest.raises(ValueError, match="a storage to save must be one of NGramStorage, OneLevelNGramStorage, got Mine"):
        save_storage(tmp_path / "c.json", Mine(3, 64), "tok")
    assert not (tmp_path / "c.json").exists()


def test_corrupt_and_foreign_files_are_one_line(tmp_path):
    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    good = tmp_path / "good.ngram"
    save_storage(good, storage, "fp")
    cases = {
        "garbage": (lambda p: p.write_bytes(b"\x00not a cache"), "cannot read the n-gram cache"),
        "truncated": (lambda p: p.write_bytes(good.read_bytes()[:40]), "is corrupt"),
        "not json": (lambda p: p.write_bytes(gzip.compress(b"{nope")), "is corrupt"),
        "other json": (lambda p: write_gzip_json(p, {"hello": 1}), "is not an n-gram cache of this program"),
        "a list": (lambda p: write_gzip_json(p, [1, 2]), "is not an n-gram cache of this program"),  # no .get
        "too deep": (lambda p: p.write_bytes(gzip.compress(b"[" * 200_000)), "is corrupt"),  # RecursionError
        "damaged stream": (lambda p: p.write_bytes(good.read_bytes()[:20] + bytes(b ^ 0x5A for b in good.read_bytes()[20:])),
                           "is corrupt \\(error\\)"),  # zlib.error behind a valid gzip header
        "bad contents": (lambda p: write_gzip_json(p, {**json.loads(gzip.decompress(good.read_bytes())),
                                                     "contexts": {"2": [[[1], [[2, 1]], 2]]}}), "bad contents"),
    }
    for name, (write, message) in cases.items():
        path = tmp_path / f"{name}.ngram"
        write(path)
        with pytest.raises(NGramCacheError, match=message) as error:
            load_storage(path, "fp", 64)
        assert "\n" not in str(error.value), name
    with pytest.raises(NGramCacheError, match="made with another tokenizer"):
        load_storage(good, "other-fp", 64)
    with pytest.raises(NGramCacheError, match="made with another tokenizer"):
        load_storage(good, "fp", 65)


def test_the_chat_loads_saves_and_survives_a_bad_cache(tmp_path):
    from transformers import AutoTokenizer

    from ngram_assisted.ngram_cache import tokenizer_fingerprint
    from test_cli import ROOT, env

    write_tiny_model(tmp_path / "m")
    cache = tmp_path / "chat.ngram"

    def run(*args, stdin=None):
        argv = [sys.executable, "infer.py", "--target", str(tmp_path / "m"), "--drafter", str(tmp_path / "m"),
                "--dtype", "float32", "--length", "12", "--ngram-cache", str(cache), *args]
        return subprocess.run(argv, cwd=ROOT, env=env(), input=stdin, capture_output=True, text=True, timeout=300)

    first = run("--prompt", "write a function")
    assert first.returncode == 0 and cache.is_file() and "loaded" not in first.stdout
    second = run("--prompt", "write code")
    assert second.returncode == 0 and "contexts loaded from" in second.stdout
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "m"))
    assert sum(len(c) for c in load_storage(cache, fingerprint, len(WORDS)).counts.values()) > 0
    cache.write_bytes(b"")  # `touch`ed: an empty storage, written after the answer (was "corrupt", never written)
    touched = run("--prompt", "write code")
    assert touched.returncode == 0 and "corrupt" not in touched.stdout and cache.stat().st_size > 0
    cache.write_bytes(b"corrupt")
    bad = run(stdin="hello world\n")  # the REPL, piped
    assert bad.returncode == 0 and "NASD starts with an empty storage" in bad.stdout
    assert bad.stdout.count("tokens/s") == 4 and "Traceback" not in bad.stdout + bad.stderr
    assert cache.read_bytes() == b"corrupt"  # left as it was


def saved_state(tmp_path) -> dict:
    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    save_storage(tmp_path / "good.ngram", storage, "fp")
    return json.loads(gzip.decompress((tmp_path / "good.ngram").read_bytes()))


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(n=30_000_000), "n = 30000000; n runs from 2 to 16"),  # took 8.7 GB and 59 s
    (lambda s: s.update(n=1), "n = 1; n runs from 2 to 16"),
    (lambda s: s.update(n="3"), "n = 3; n runs from 2 to 16"),
    (lambda s: s["contexts"]["1"].append([[5], [[7, 1]], -1]), "bad contents"),  # the KeyError: -1 of issue 25
    (lambda s: s["contexts"]["1"].append([[5], [[7, 1]], 9]), "bad contents"),  # best is no follower
    (lambda s: s["contexts"]["1"].append([[64], [[7, 1]], 7]), "bad contents"),  # past the vocabulary
    (lambda s: s["contexts"]["1"].append([[-3], [[7, 1]], 7]), "bad contents"),
    (lambda s: s["contexts"]["1"].append([[5], [[70, 1]], 70]), "bad contents"),
    (lambda s: s["contexts"]["1"].append([[5], [[7, 0]], 7]), "bad contents"),  # a count of nothing
    (lambda s: s["contexts"]["1"].append([[5], [[7, 1.5]], 7]), "bad contents"),
    (lambda s: s["contexts"]["1"].append([[True], [[7, 1]], 7]), "bad contents"),
    (lambda s: s["contexts"]["1"].append([[5], [], 7]), "bad contents"),
    (lambda s: s["contexts"].pop("2"), "bad contents"),
    (lambda s: s.update(version=2), "has version 2, this program reads 1"),  # a later format is not guessed at
    (lambda s: s.update(kind="trie"), "bad contents"),  # KeyError
    (lambda s: s["contexts"]["1"].append([[5, 6], [[7, 1]], 7]), "bad contents"),  # a context of another length
    (lambda s: s["contexts"]["1"].append([[5], [[1, 1]], True]), "bad contents"),  # True == 1 as a key
    (lambda s: s["contexts"]["1"].append([5, [[7, 1]], 7]), "bad contents"),  # TypeError: an int is no context
    (lambda s: s["contexts"]["1"].append([[5], [7], 7]), "bad contents"),  # TypeError: a follower is no pair
])
def test_crafted_contents_are_refused_before_anything_is_built(tmp_path, change, message):
    state = saved_state(tmp_path)
    change(state)
    write_gzip_json(tmp_path / "crafted.ngram", state)
    with pytest.raises(NGramCacheError, match=message) as error:
        load_storage(tmp_path / "crafted.ngram", "fp", 64)
    assert "\n" not in str(error.value)


def test_a_gzip_bomb_is_read_only_up_to_the_bound(tmp_path, monkeypatch):
    """A 2 MB gzip that inflated to 2 GB was read whole (4.6 GB); here a bound of 1 MB and 20 MB of spaces."""
    import tracemalloc

    from ngram_assisted import ngram_cache

    monkeypatch.setattr(ngram_cache, "MAX_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.ngram"
    with gzip.open(bomb, "wb") as f:
        for _ in range(20):
            f.write(b" " * (1 << 20))
    tracemalloc.start()
    with pytest.raises(NGramCacheError, match="inflates to more than 1 MB"):
        load_storage(bomb, "fp", 64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20


def test_a_storage_past_the_bound_is_not_saved_so_what_is_saved_loads(tmp_path, monkeypatch):
    from ngram_assisted import ngram_cache

    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    save_storage(tmp_path / "c.ngram", storage, "fp")
    before = (tmp_path / "c.ngram").read_bytes()
    monkeypatch.setattr(ngram_cache, "MAX_BYTES", 100)
    with pytest.raises(NGramCacheError, match="has outgrown 0 MB and is no longer saved"):
        save_storage(tmp_path / "c.ngram", storage, "fp")
    assert (tmp_path / "c.ngram").read_bytes() == before


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symbolic_link_is_written_through(tmp_path, dangling):
    """Issue 25: the link was replaced by a regular file; the file it points to is replaced instead."""
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "real.ngram"
    if not dangling:
        target.write_bytes(b"old")
    link = tmp_path / "link.ngram"
    link.symlink_to(target)
    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    save_storage(link, storage, "fp")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert load_storage(target, "fp", 64).counts == storage.counts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link.ngram"]  # no temporary file left


def test_where_a_cache_cannot_be_saved_is_said_before_anything_loads(tmp_path, monkeypatch):
    from ngram_assisted import ngram_cache
    from utils.paths import unwritable

    assert unwritable(str(tmp_path / "new.ngram")) is None  # a new file in a folder that takes files
    assert unwritable(" ") == "give a file's path"
    assert "is a folder" in unwritable(str(tmp_path))
    assert unwritable(str(tmp_path / "missing" / "x.ngram")) == f"no folder {tmp_path / 'missing'} to keep x.ngram in"
    long = unwritable(str(tmp_path / ("x" * 300)))  # `is_dir` raises for it: was a traceback
    if os.path.isdir("/proc"):  # root passed the permission check there, and the first save failed after an answer
        assert unwritable("/proc/version").startswith("cannot write in /proc")  # ": reason" only where root probed
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the probe leaves nothing behind
    assert long.startswith("cannot use ") and long.endswith(": File name too long") and len(long) < 250
    # a folder this user may not write in (root may write anywhere, so the permission is asked of a stand-in)
    monkeypatch.setattr(ngram_cache.os, "access", lambda path, mode: str(path) != str(tmp_path))
    assert unwritable(str(tmp_path / "x.ngram")) == f"cannot write in {tmp_path}"


@pytest.mark.parametrize("signal_exit", [KeyboardInterrupt, SystemExit])
def test_a_save_cut_by_a_signal_leaves_the_old_file_and_no_half_one(tmp_path, monkeypatch, signal_exit):
    """SIGTERM's SystemExit or Ctrl-C mid-write left a hidden `.chat.ngram.PID.tmp` beside the file. Half the data
    reaches the disk before the signal: a save written straight to the file would leave it cut short, and the next
    start would call it corrupt and lose all it learned."""
    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    path = tmp_path / "chat.ngram"
    save_storage(path, storage, "fp")
    before = path.read_bytes()
    storage.add_sequence([5, 6, 7, 5, 6, 8])  # what the cut save would have added
    write = gzip.GzipFile.write

    def cut(self, data):
        write(self, data[: len(data) // 2])
        self.close()
        raise signal_exit()

    monkeypatch.setattr(gzip.GzipFile, "write", cut)
    with pytest.raises(signal_exit):
        save_storage(path, storage, "fp")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["chat.ngram"]


def test_a_context_given_no_follower_is_not_recorded_so_the_storage_saves(tmp_path):
    """`update` with an empty row of next tokens left a context with no best follower: saving raised KeyError."""
    storage = NGramStorage(3, 64)
    storage.update(torch.tensor([[1, 2]]), torch.zeros(1, 0, dtype=torch.long))
    storage.add_sequence(TOKENS)
    save_storage(tmp_path / "c.ngram", storage, "fp")
    assert (1, 2) not in storage.counts[2]
    assert load_storage(tmp_path / "c.ngram", "fp", 64).draft(TOKENS[:2], 3) == storage.draft(TOKENS[:2], 3)


def test_a_storage_of_exactly_the_bound_is_saved_and_loads_back(tmp_path, monkeypatch):
    """save_storage refuses only what load_storage would: what is saved at the bound loads back."""
    from ngram_assisted import ngram_cache

    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    path = tmp_path / "c.ngram"
    save_storage(path, storage, "fp")
    size = len(gzip.decompress(path.read_bytes()))
    monkeypatch.setattr(ngram_cache, "MAX_BYTES", size)
    save_storage(path, storage, "fp")
    assert load_storage(path, "fp", 64).counts == storage.counts
    monkeypatch.setattr(ngram_cache, "MAX_BYTES", size - 1)
    with pytest.raises(NGramCacheError, match="inflates to more than"):
        load_storage(path, "fp", 64)
    with pytest.raises(NGramCacheError, match="has outgrown"):
        save_storage(path, storage, "fp")


def test_the_save_is_on_the_disk_before_it_replaces_the_old_file(tmp_path, monkeypatch):
    """A power cut after the rename but before the data reached the disk would leave an empty file where the old
    one was: every byte is flushed and synced before the rename."""
    from ngram_assisted import ngram_cache

    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(ngram_cache.os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_size)), fsync(fd)))
    monkeypatch.setattr(ngram_cache.os, "replace", lambda a, b: (events.append(("replace",)), replace(a, b)))
    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    save_storage(tmp_path / "c.ngram", storage, "fp")
    assert events == [("fsync", (tmp_path / "c.ngram").stat().st_size), ("replace",)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ngram"]  # the temporary file is the one renamed


def test_a_save_that_fails_is_one_line_and_leaves_the_old_file_and_no_half_one(tmp_path, monkeypatch):
    from ngram_assisted import ngram_cache

    storage = NGramStorage(3, 64)
    storage.add_sequence(TOKENS)
    path = tmp_path / "c.ngram"
    save_storage(path, storage, "fp")
    before = path.read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ngram_cache.os, "fsync", full)
    storage.add_sequence([5, 6, 9])
    with pytest.raises(NGramCacheError, match=f"^cannot write the n-gram cache {path}: No space left on device$"):
        save_storage(path, storage, "fp")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.ngram"]


@pytest.mark.parametrize("change", [
    lambda s: s["contexts"]["1"].append([[70], [[7, 1]], 7]),  # an id of the model's padding, not the file's
    lambda s: s["contexts"]["1"].append([[5], [[70, 1], [7, 2]], 7]),  # a follower of the padding
    lambda s: s.update(vocab_size="64"),  # was a TypeError from comparing it
    lambda s: s.update(vocab_size=True),
])
def test_a_padded_load_takes_only_ids_of_the_file_s_vocabulary(tmp_path, change):
    """A prior loaded for a model with a larger embedding (`padded`): its ids must be below its own vocab_size,
    which must be a number."""
    state = saved_state(tmp_path)
    write_gzip_json(tmp_path / "good.ngram", state)
    assert load_storage(tmp_path / "good.ngram", "fp", 80, padded=True).counts[2]  # the unchanged file loads
    change(state)
    write_gzip_json(tmp_path / "crafted.ngram", state)
    with pytest.raises(NGramCacheError, match="another tokenizer|bad contents"):
        load_storage(tmp_path / "crafted.ngram", "fp", 80, padded=True)


def test_the_fingerprint_is_the_one_saved_files_are_named_after():
    """The fingerprint is written in every saved cache and names the shipped priors: computed any other way it
    would orphan them all, and the prior would silently stop loading. Pinned for a small vocabulary."""
    from types import SimpleNamespace

    from ngram_assisted.ngram_cache import tokenizer_fingerprint, unpadded_fingerprint

    tokenizer = SimpleNamespace(get_vocab=lambda: {"[PAD2]": 2, "é": 1, "a": 0})
    assert tokenizer_fingerprint(tokenizer) == "5df58ff664dba6a9"
    assert unpadded_fingerprint(tokenizer) == "48315b01c2b369f1"
