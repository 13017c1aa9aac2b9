"""The cache keeps what starts use: entries of ours that no start has used for `UNUSED_DAYS` are removed (a kernel
build, a prepared folder, a kernel choice, an assembled GGUF file), nothing else is, and a start marks what it
uses, so what it needs is never removed. A disk that fills while a model is prepared frees the entries this start
has not used, whatever their age (those this set-up loads last), and the preparation is tried again while any go."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from gguf_models import write_tiny_gguf
from test_cli import ROOT, env
from utils.models import cache_prune
from utils.models.kernel_choice import KernelChoice
from utils.models.load_error import ModelLoadError
from utils.models.prepared_folder import SOURCE_MARKER, publish_folder, ready

DAY = 86400


def age(path, days):
    then = time.time() - days * DAY
    os.utime(path, (then, then), follow_symlinks=False)


def prepared(folder):
    folder.mkdir()
    (folder / "native-state.pt").write_bytes(b"x" * 1000)
    (folder / SOURCE_MARKER).write_text("{}")
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    return root


def test_entries_of_ours_unused_for_a_month_are_removed_and_nothing_else(cache, capsys):
    old = {
        "a prepared folder": prepared(cache / "m-native-0123456789ab"),
        "a kernel build": cache / "qkernels-0123456789abcdef",
        "a kernel choice": cache / "kernels-0123456789ab.json",
        "a draft cap's timings": cache / "draft-cap-0123456789ab.json",
        "an assembled GGUF file": cache / "embedded.gguf",
    }
    old["a kernel build"].mkdir()
    (old["a kernel build"] / "specdec_qkernels.so").write_bytes(b"y" * 500)
    old["a kernel choice"].write_text("{}")
    old["a draft cap's timings"].write_text("{}")
    old["an assembled GGUF file"].write_bytes(b"z" * 2000)
    kept = {
        "a prepared folder used 29 days ago": prepared(cache / "m-native-ba9876543210"),
        "a user's file": cache / "notes.txt",
        "a user's file named like timings": cache / "draft-cap-mine.json",
        "a user's GGUF file": cache / "mine.gguf",
        "a folder without our record": cache / "photos",
        "a link named like a build": cache / "qkernels-fedcba9876543210",
        "a work folder (the sweep's)": cache / ".m.0123456789ab.pid1.x",
    }
    kept["a user's file"].write_text("mine")
    kept["a user's file named like timings"].write_text("{}")
    kept["a user's GGUF file"].write_bytes(b"g")
    kept["a folder without our record"].mkdir()
    kept["a link named like a build"].symlink_to(kept["a folder without our record"])
    kept["a work folder (the sweep's)"].mkdir()
    for path in [*old.values(), *kept.values()]:
        age(path, 31)
    age(kept["a prepared folder used 29 days ago"], 29)

    removed = cache_prune.prune_unused({"embedded.gguf"})

    assert sorted(removed) == sorted(old.values())
    assert not any(os.path.lexists(path) for path in old.values())
    assert all(os.path.lexists(path) for path in kept.values())
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"removed 5 entries unused for 30 days from the cache {cache} (0.00 GB; a start that needs one "
                     "makes it again)"]
    assert cache_prune.prune_unused({"embedded.gguf"}) == [] and capsys.readouterr().err == ""


def test_a_start_marks_the_prepared_folder_and_kernel_choice_it_uses(cache):
    def write(work, out):
        out.mkdir()
        (out / "config.json").write_text("{}")

    folder = publish_folder(cache / "m-folder", "m", "id", write)
    choice = KernelChoice(cache)
    choice.path.write_text(json.dumps({"machine": choice.description, "shapes": {}}))
    for path in (folder, choice.path):
        age(path, 40)
    assert ready(folder, "id", "m") and KernelChoice(cache).path == choice.path
    assert cache_prune.prune_unused(set()) == []
    assert folder.is_dir() and choice.path.is_file()
    assert time.time() - folder.stat().st_mtime < DAY and time.time() - choice.path.stat().st_mtime < DAY


def test_the_cli_keeps_what_it_loads_and_removes_a_stale_copy(tmp_path):
    """End to end: a month after its last start, a start keeps the prepared folder it loads and removes another
    copy of it (one a kernel change left behind)."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    cache = tmp_path / "cache"
    argv = [sys.executable, "infer.py", "--target", str(gguf), "--drafter", str(gguf), "--device", "cpu",
            "--kernels", "f32", "--json", "--length", "2", "--prompt", "hello"]

    def run():
        done = subprocess.run(argv, cwd=ROOT, env=env(SPECDEC_CACHE_DIR=str(cache)), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    run()
    (folder,) = [p for p in cache.iterdir() if p.name.startswith("tiny-") and p.is_dir()]
    stale = cache / folder.name.replace("tiny-", "tiny-stale-")
    shutil.copytree(folder, stale)
    entries = sorted(cache.iterdir())
    for path in entries:
        age(path, 31)
    stderr = run()
    assert f"removed 1 entry unused for 30 days from the cache {cache}" in stderr
    assert sorted(cache.iterdir()) == [p for p in entries if p != stale]


def free_space():
    return cache_prune.free_for_this_start(set())


def failing_first(times: int):
    """A `make` for publish_folder whose first `times` calls fill the disk (ENOSPC), the next ones write."""
    calls = []

    def make(work, out):
        calls.append(out)
        out.mkdir()
        (out / "native-state.pt").write_bytes(b"x" * 1000)
        if len(calls) <= times:
            raise OSError(28, "No space left on device")

    return make, calls


def test_a_full_disk_while_preparing_frees_what_this_start_does_not_use_and_tries_again(cache, capsys):
    stale = prepared(cache / "m-native-0123456789ab")  # a copy an older kernel build left, used yesterday
    build = cache / "qkernels-0123456789abcdef"
    build.mkdir()
    (build / "specdec_qkernels.so").write_bytes(b"y" * 500)
    in_use = publish_folder(cache / "d-native-ba9876543210", "d", "id", lambda work, out: prepared(out))
    notes = cache / "notes.txt"  # not ours
    notes.write_text("mine")
    for path in (stale, build, in_use, notes):
        age(path, 1)
    assert ready(in_use, "id", "d")  # this start loads it: marked
    make, calls = failing_first(1)
    folder = publish_folder(cache / "m-native-fedcba987654", "m", "id", make, free_space)
    assert len(calls) == 2 and ready(folder, "id", "m")
    assert not stale.exists() and not build.exists() and in_use.is_dir() and notes.read_text() == "mine"
    err = capsys.readouterr().err
    assert f"the disk holding the cache {cache} is full: removed 2 entries of it that this start does not use" in err
    assert "trying again" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("stale_too", [True, False])
def test_a_full_disk_spares_the_pair_s_other_model_while_anything_else_can_go(cache, capsys, stale_too):
    """The target prepared on a full disk removed the drafter's folder, prepared for this very set-up, which the
    same start then prepared again. Now what no start here would load goes first, and the drafter's folder only
    when nothing else frees space."""
    from types import SimpleNamespace

    from utils.models import model_loader

    kernels, tag = SimpleNamespace(digest="fedcba987654"), model_loader.writer_tag()
    drafter = prepared(cache / f"d-native-fedcba987654-int4drafter-{tag}")  # prepared yesterday, loaded next
    stale = [prepared(cache / f"d-native-0123456789ab-int4drafter-{tag}"),  # another kernel choice's
             prepared(cache / "d-native-fedcba987654-int4drafter-tf0.0.1")]  # another transformers'
    for path in [drafter] + stale:
        age(path, 1)
        if not stale_too and path in stale:
            shutil.rmtree(path)
    make, calls = failing_first(1)
    target = cache / f"m-native-fedcba987654-{tag}"
    assert publish_folder(target, "m", "id", make, model_loader.cache_freer(kernels)) == target
    assert len(calls) == 2 and ready(target, "id", "m")
    assert drafter.is_dir() is stale_too and not any(path.exists() for path in stale)
    removed = "removed 2 entries" if stale_too else "removed 1 entry"
    assert capsys.readouterr().err.count(removed) == 1


def test_the_pair_s_other_model_goes_last_when_the_first_entries_freed_are_not_enough(cache, capsys):
    from types import SimpleNamespace

    from utils.models import model_loader

    kernels, tag = SimpleNamespace(digest="fedcba987654"), model_loader.writer_tag()
    drafter = prepared(cache / f"d-native-fedcba987654-{tag}")
    stale = prepared(cache / "d-native-0123456789ab-tf0.0.1")
    age(drafter, 1), age(stale, 1)
    make, calls = failing_first(2)
    target = cache / f"m-native-fedcba987654-{tag}"
    assert publish_folder(target, "m", "id", make, model_loader.cache_freer(kernels)) == target
    assert len(calls) == 3 and not drafter.exists() and not stale.exists()
    assert capsys.readouterr().err.count("is full: removed 1 entry") == 2


def test_entries_marked_just_before_this_start_are_kept_when_the_disk_fills(cache):
    """Another start's entry marked moments before this one began (or a shared cache's server clock a little
    behind) is not taken for an unused one."""
    recent = prepared(cache / "m-native-0123456789ab")
    then = cache_prune.STARTED - cache_prune.CLOCK_SLACK_S / 2
    os.utime(recent, (then, then))
    assert cache_prune.free_for_this_start(set()) is False and recent.is_dir()


@pytest.mark.parametrize("stale_entry", [False, True])
def test_a_disk_still_full_says_so_in_one_line(cache, stale_entry):
    """Nothing to free: one try, the full-disk line. Freed but still full: two tries, the same line. No work folder
    is left behind either way."""
    if stale_entry:
        age(prepared(cache / "m-native-0123456789ab"), 1)
    make, calls = failing_first(2)
    with pytest.raises(ModelLoadError) as caught:
        publish_folder(cache / "m-native-fedcba987654", "m", "id", make, free_space)
    assert len(calls) == (2 if stale_entry else 1)
    assert f"the disk holding {cache} is full" in str(caught.value) and "\n" not in str(caught.value)
    assert list(cache.iterdir()) == []


def test_the_loader_frees_the_cache_when_preparing_a_model_fills_the_disk(cache, tmp_path, monkeypatch, capsys):
    """The wiring: a GGUF file prepared while the disk is full frees the cache's unused entries (an assembled
    embedded file here, 1 day old) and is prepared on the second try."""
    from utils.models import model_loader
    from utils.models.embedded_models import EMBEDDED

    assembled = cache / next(iter(EMBEDDED.values())).gguf_name
    assembled.write_bytes(b"z" * 2000)
    age(assembled, 1)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    real, calls = model_loader.prepare_native_folder, []

    def prepare_filling_the_disk_once(gguf, out, *args):
        calls.append(out)
        if len(calls) == 1:
            out.mkdir(parents=True)
            raise OSError(28, "No space left on device")
        return real(gguf, out, *args)

    monkeypatch.setattr(model_loader, "prepare_native_folder", prepare_filling_the_disk_once)
    model, _ = model_loader.load_model(str(gguf), device="cpu", kernels="f32", progress=False)
    assert model is not None and len(calls) == 2 and not assembled.exists()
    assert "is full: removed 1 entry of it that this start does not use" in capsys.readouterr().err


def test_a_cache_this_user_may_not_write_is_pruned_without_a_traceback(cache, monkeypatch):
    """A read-only cache (an image's): once its kernel choice was 30 days old, every start died in the prune with
    PermissionError from the unlink; folders were already skipped quietly."""
    from pathlib import Path

    choice = cache / "kernels-0123456789ab.json"
    choice.write_text("{}")
    age(choice, 40)

    def denied(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", denied)
    assert cache_prune.prune_unused(set()) == [] and choice.exists()  # nothing removed, nothing said


def test_an_error_that_is_no_full_disk_is_not_taken_for_one_on_a_nearly_full_disk(cache, monkeypatch):
    """Under 64 MiB free (the assembled file still in the work folder), a damaged package's checksum error was
    "the disk is full", and the cache's other entries were deleted for a second try."""
    from utils.models import cache_folder

    monkeypatch.setattr(cache_folder, "NEARLY_FULL", 1 << 62)  # every disk reads as nearly full
    freed = []

    def damaged(work, out):
        raise ModelLoadError("demo: part 2 does not match its sha256")

    with pytest.raises(ModelLoadError, match="does not match its sha256"):
        publish_folder(cache / "m-native-fedcba987654", "m", "id", damaged,
                       lambda: len(freed) < 3 and (freed.append(1) or True))  # bounded: a regression fails, not hangs
    assert freed == [] and list(cache.iterdir()) == []
    with pytest.raises(ModelLoadError, match="is full"):  # a write's error is still judged by the free space
        publish_folder(cache / "m-native-fedcba987654", "m", "id", lambda w, o: (_ for _ in ()).throw(
            RuntimeError("[enforce fail at inline_container.cc] unexpected pos")))


def test_a_file_written_in_one_step_leaves_no_dot_file_when_interrupted(tmp_path, monkeypatch):
    from utils.models import cache_folder

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_folder.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache_folder.write_in_one_step(tmp_path / "kernels-x.json", b"{}")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_another_start_published_during_the_rename_is_taken(cache, monkeypatch):
    """Two starts preparing one folder: the other's rename landing between this one's check and its own rename
    failed this one with ENOTEMPTY, a traceback."""
    from pathlib import Path

    from utils.models import prepared_folder

    real, raced = os.replace, []
    target = cache / "m-native-fedcba987654"

    def rename(src, dst):
        if Path(dst) == target and not raced:
            raced.append(1)
            publish_folder(target, "m", "id", lambda work, out: prepared(out))  # the other start's, first
            raise OSError(39, "Directory not empty", str(src))
        return real(src, dst)

    monkeypatch.setattr(prepared_folder.os, "replace", rename)
    assert publish_folder(target, "m", "id", lambda work, out: prepared(out)) == target
    assert raced and ready(target, "id", "m") and [p.name for p in cache.iterdir()] == [target.name]


def test_removing_a_link_to_a_folder_removes_the_link_and_not_what_it_names(tmp_path):
    # a link in the cache may name a user's folder: only the link is ours to remove
    from utils.models.cache_folder import remove

    target = tmp_path / "mine"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(target)
    remove(link)
    assert not os.path.lexists(link) and (target / "keep.txt").read_text() == "mine"


def test_a_process_of_another_user_counts_as_running(monkeypatch):
    # kill(pid, 0) on another user's process is EPERM: its work is still being written, not abandoned
    from utils.models import cache_folder

    def denied(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(cache_folder.os, "kill", denied)
    assert cache_folder.process_alive(12345) is True


def test_only_whole_names_of_ours_are_removed(cache):
    # a name that merely starts or ends like ours is a user's file (a backup, a copy): never touched
    names = ["qkernels-0123456789abcdef-old", "qkernels-0123456789ab",  # folders, no prepared record
             "kernels-0123456789ab.json.bak", "old-draft-cap-0123456789ab.json"]
    for name in names:
        path = cache / name
        path.mkdir() if name.startswith("qkernels") else path.write_text("{}")
        age(path, 40)
    assert cache_prune.prune_unused(set()) == [] and sorted(p.name for p in cache.iterdir()) == sorted(names)


@pytest.mark.parametrize("how", ["unused for days", "full disk"])
def test_the_line_says_the_bytes_that_went(cache, tmp_path, capsys, how):
    """The size in the line is every file the removed entries held, nested ones included, but not what a link in a
    prepared folder names (outside the cache, it stays). Sparse files: a gigabyte costs no disk here."""
    def sparse(path, size):
        with path.open("wb") as f:
            f.truncate(size)

    outside = tmp_path / "outside.bin"
    sparse(outside, 4 * 10**9)
    assembled = cache / "embedded.gguf"
    choice = cache / "kernels-0123456789ab.json"
    folder = prepared(cache / "m-native-0123456789ab")  # 1000 + 2 bytes at its top
    (folder / "tokenizer").mkdir()
    for path, size in ((assembled, 10**9), (choice, 250 * 10**6), (folder / "tokenizer" / "big.bin", 500 * 10**6)):
        sparse(path, size)
    (folder / "linked.bin").symlink_to(outside)
    for path in (assembled, choice, folder):
        age(path, 10)
    if how == "full disk":
        assert cache_prune.free_for_this_start({"embedded.gguf"}) is True
        assert "removed 3 entries of it that this start does not use (1.75 GB;" in capsys.readouterr().err
    else:
        assert len(cache_prune.prune_unused({"embedded.gguf"}, days=7)) == 3
        assert f"removed 3 entries unused for 7 days from the cache {cache} (1.75 GB;" in capsys.readouterr().err
    assert list(cache.iterdir()) == [] and outside.stat().st_size == 4 * 10**9


def test_a_cache_folder_not_made_yet_has_nothing_to_prune(tmp_path, monkeypatch, capsys):
    # a first start that prepared nothing may have no cache folder: no traceback, and none made by the prune
    missing = tmp_path / "none"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(missing))
    assert cache_prune.prune_unused(set()) == [] and cache_prune.free_for_this_start(set()) is False
    assert not missing.exists() and capsys.readouterr().err == ""


def test_an_entry_marked_at_the_cutoff_is_used_and_one_before_it_is_not(cache):
    cutoff = int(time.time()) - 1000  # whole seconds: the modification time holds it exactly
    at, before = prepared(cache / "m-native-0123456789ab"), prepared(cache / "m-native-ba9876543210")
    os.utime(at, ns=(cutoff * 10**9, cutoff * 10**9))
    os.utime(before, ns=((cutoff - 1) * 10**9, (cutoff - 1) * 10**9))
    assert cache_prune.remove_unused_since(cutoff, set()) == ([before], 1002)
    assert at.is_dir()


def test_an_entry_another_start_removes_meanwhile_is_skipped(cache):
    # two starts pruning one cache: an entry gone between the listing and its check is not this start's error
    gone, other = prepared(cache / "m-native-0123456789ab"), prepared(cache / "m-native-ba9876543210")
    for path in (gone, other):
        age(path, 40)

    def removed_by_the_other_start(name):
        if name == gone.name:
            shutil.rmtree(gone)
        return False

    assert cache_prune.remove_unused_since(time.time() - DAY, set(), removed_by_the_other_start) == ([other], 1002)


def test_on_a_full_disk_only_the_last_minute_before_this_start_counts_as_this_start_s(cache):
    # the slack covers a server clock a little behind, not an entry marked ten minutes before this start began
    earlier = prepared(cache / "m-native-0123456789ab")
    then = cache_prune.STARTED - 600
    os.utime(earlier, (then, then))
    assert cache_prune.free_for_this_start(set()) is True and not earlier.exists()


def test_on_a_full_disk_an_empty_entry_removed_counts_as_freed(cache):
    # "whether any went", not "whether bytes went": an interrupted build's empty folder gone frees an inode (a disk
    # out of inodes is ENOSPC too), and the caller tries again only on True
    build = cache / "qkernels-0123456789abcdef"
    build.mkdir()
    age(build, 1)
    assert cache_prune.free_for_this_start(set()) is True and not build.exists()


def test_the_prepared_folder_of_a_gguf_file_named_with_a_leading_dot_is_pruned_too(cache):
    """A ".hidden.gguf" gets the prepared folder ".hidden-<identity>-native-…": every name starting with a dot was
    skipped, so that 1 GB-scale folder stayed forever. Work in progress (the sweep's) is still never touched."""
    hidden = prepared(cache / ".hidden-01f9f98ddf-native-0123456789ab-f32-tf5.23.0")
    work = cache / ".m.0123456789ab.pid1.x"  # a conversion being written, whatever it holds
    prepared(work)
    for path in (hidden, work):
        age(path, 40)
    assert cache_prune.prune_unused(set()) == [hidden] and work.is_dir()
