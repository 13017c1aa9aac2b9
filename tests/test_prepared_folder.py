"""The prepared cache heals itself (issue 25): a prepared folder records what it holds, any damage is named in one
line and the folder prepared again from its source; a full disk says so."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types

import pytest

from gguf_models import write_tiny_gguf
from test_cli import ROOT, env
from utils.models import model_loader, prepared_folder
from utils.models.model_loader import ModelLoadError, ModelSpec, native_folder

KERNELS = types.SimpleNamespace(digest="test", override=None)  # the folder name's kernel key


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A `.gguf` source, its folder prepared by a stand-in for the native preparation that counts its runs."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    runs = []

    def prepare(gguf, out, kernels, drafter_int4, progress, label):
        runs.append(label)
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"model_type": "qwen2"}')
        (out / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}}')
        (out / "chat_template.jinja").write_text("{{ messages }}")
        (out / model_loader.STATE_FILE).write_bytes(os.urandom(1 << 16))

    monkeypatch.setattr(model_loader, "prepare_native_folder", prepare)
    spec = ModelSpec("gguf", str(gguf))
    return lambda: native_folder(spec, KERNELS, False, progress=False), runs


def garble_inside(path):
    data = bytearray(path.read_bytes())
    data[4096:8192] = os.urandom(4096)  # the same size: only the checksum sees it
    path.write_bytes(bytes(data))


DAMAGE = {
    "lost tokenizer.json": (lambda f: (f / "tokenizer.json").unlink(), "lost tokenizer.json"),
    "lost chat_template.jinja": (lambda f: (f / "chat_template.jinja").unlink(), "lost chat_template.jinja"),
    "truncated state": (lambda f: os.truncate(f / model_loader.STATE_FILE, 100), "has native-state.pt at 100 bytes"),
    "emptied state": (lambda f: os.truncate(f / model_loader.STATE_FILE, 0), "has native-state.pt at 0 bytes"),
    "grown state": (lambda f: os.truncate(f / model_loader.STATE_FILE, (1 << 16) + 100),  # a size either way
                    "has native-state.pt at 65636 bytes"),
    "4 KB of random bytes inside": (lambda f: garble_inside(f / model_loader.STATE_FILE),
                                    "has native-state.pt changed since it was written"),
    "garbage config": (lambda f: (f / "config.json").write_text('{"model_type": "qwen3"}'), "has config.json changed"),
    "garbage record": (lambda f: (f / model_loader.SOURCE_MARKER).write_bytes(b"\x00\xff"), "no readable record"),
    "record not an object": (lambda f: (f / model_loader.SOURCE_MARKER).write_text("[1, 2]"), "no readable record"),
    "an earlier version's record": (lambda f: (f / model_loader.SOURCE_MARKER).write_text('{"sha256": "x"}'),
                                    "an earlier version"),
    "an extra file": (lambda f: (f / "tokenizer.model").write_bytes(b"x"), "holds tokenizer.model"),
    "a file where the folder was": (lambda f: (shutil.rmtree(f), f.write_text("x")), "is not a folder"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_named_in_one_line_and_the_folder_prepared_again(source, capsys, case):
    load, runs = source
    folder = load()
    intact = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert runs == ["m.gguf"] and load() == folder and runs == ["m.gguf"]  # a sound folder is kept
    damage, problem = DAMAGE[case]
    damage(folder)
    capsys.readouterr()
    assert load() == folder and runs == ["m.gguf", "m.gguf"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0] and "preparing it again from" in lines[0] and "m.gguf" in lines[0]
    assert set(intact) == {p.name for p in folder.iterdir()}
    assert load() == folder and runs == ["m.gguf", "m.gguf"]  # healed: the next start keeps it
    # no work left behind (the lock two starts take turns with stays, empty: `one_start_at_a_time`)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == [".prepare.lock"]


def count_reads(monkeypatch) -> list[str]:
    reads, real = [], prepared_folder.checksum
    monkeypatch.setattr(prepared_folder, "checksum", lambda path: reads.append(path.name) or real(path))
    return reads


def test_another_transformers_release_prepares_its_own_folder(source, monkeypatch):
    """The folder's config and tokenizer are transformers' conversion of the file's metadata: a release that
    converts otherwise must not load what an earlier one wrote."""
    load, runs = source
    first = load()
    with monkeypatch.context() as patch:
        patch.setattr(model_loader.transformers, "__version__", "0.0.1-another")
        second = load()
    assert second != first and "tf0.0.1-another" in second.name and runs == ["m.gguf", "m.gguf"]
    assert first.is_dir()  # left for the cache's pruning of unused entries, not removed under a running start
    assert load() == first and len(runs) == 2


def test_a_file_found_intact_is_not_read_again_until_something_writes_it(source, monkeypatch, capsys):
    """A warm start read the whole default pair for its CRC-32s (0.5-1.1 s): a file found intact is stamped with
    its stat and not read again; a write moves its change time, even one that keeps the size and sets the
    modification time back."""
    monkeypatch.setattr(prepared_folder, "SETTLED_NS", 0)  # these files were written a moment ago
    load, runs = source
    folder = load()
    files = prepared_folder.listed(folder)
    time.sleep(0.05)  # past the filesystem's timestamp tick: a write from now on moves the change time
    reads = count_reads(monkeypatch)
    assert load() == folder and sorted(reads) == files
    reads.clear()
    assert load() == folder and reads == [] and runs == ["m.gguf"]
    state = folder / model_loader.STATE_FILE
    before = state.stat()
    garble_inside(state)
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert state.stat().st_size == before.st_size and state.stat().st_mtime_ns == before.st_mtime_ns
    capsys.readouterr()
    assert load() == folder and runs == ["m.gguf", "m.gguf"]
    assert "has native-state.pt changed since it was written" in capsys.readouterr().err


@pytest.mark.parametrize("stamp", [b"\x00\xff", b"[1, 2]", b'{"native-state.pt": 7}'])
def test_a_damaged_stamp_means_the_files_are_read_again(source, monkeypatch, stamp):
    monkeypatch.setattr(prepared_folder, "SETTLED_NS", 0)
    load, runs = source
    folder = load()
    time.sleep(0.05)
    assert load() == folder and (folder / prepared_folder.STAMP).is_file()
    (folder / prepared_folder.STAMP).write_bytes(stamp)
    reads = count_reads(monkeypatch)
    assert load() == folder and sorted(reads) == prepared_folder.listed(folder) and runs == ["m.gguf"]
    reads.clear()
    assert load() == folder and reads == []  # stamped again


def test_a_file_written_just_before_its_check_is_read_again(source, monkeypatch):
    """A second write in the tick of the checked one would leave the stat the stamp holds: such a file is not
    stamped until it has settled."""
    load, runs = source
    folder = load()
    reads = count_reads(monkeypatch)
    assert load() == folder and load() == folder and runs == ["m.gguf"]
    assert sorted(reads) == sorted(prepared_folder.listed(folder) * 2)
    assert not (folder / prepared_folder.STAMP).exists()


def test_a_folder_another_start_finished_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two first starts prepare at once: the second to finish keeps the first's folder, which may be in use."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "m-folder"

    def make(content):
        def write(work, out):
            out.mkdir()
            (out / "config.json").write_text(content)
        return write

    model_loader.publish_folder(folder, "m", "id", make("first"))
    inode = folder.stat().st_ino
    assert model_loader.publish_folder(folder, "m", "id", make("second")) == folder
    assert (folder / "config.json").read_text() == "first" and folder.stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == ["m-folder"]


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64"),
                                   OSError(28, "No space left on device")])
def test_a_full_disk_while_preparing_says_so(tmp_path, monkeypatch, error):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    real_usage = shutil.disk_usage

    def fail(work, out):
        out.mkdir()
        (out / "native-state.pt").write_bytes(b"x" * 1000)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=4096))  # what is left now
        raise error

    with pytest.raises(ModelLoadError) as caught:
        model_loader.publish_folder(tmp_path / "m-folder", "m", "id", fail)
    message = str(caught.value)
    assert f"the disk holding {tmp_path} is full" in message and "SPECDEC_CACHE_DIR" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # the work folder is gone, freeing its space


def test_safetensors_full_disk_is_one_line_even_once_space_is_back(tmp_path, monkeypatch):
    """A sweep (`--dtype float32`, the embedded pair, a shared disk): safetensors raises its own SafetensorError,
    no OSError, and by the check the failed file's space was free again: 172 lines of traceback."""
    from safetensors import SafetensorError

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=10 << 30))

    def fail(work, out):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(ModelLoadError, match=f"^the disk holding {re.escape(str(tmp_path))} is full; "):
        model_loader.publish_folder(tmp_path / "m-folder", "m", "id", fail)


def test_another_error_with_room_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=10 << 30))

    def fail(work, out):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        model_loader.publish_folder(tmp_path / "m-folder", "m", "id", fail)


@pytest.mark.parametrize("error, free, full", [
    (OSError(errno.EDQUOT, "quota"), 10 << 30, True),  # a quota: the disk has room, the user has none
    (RuntimeError("I/O error: Disk quota exceeded"), 10 << 30, True),  # a writer's own error, said in words
    (OSError(errno.EIO, "Input/output error"), 10 << 30, False),  # room left: a write's error is what it says
    (OSError(errno.EIO, "Input/output error"), (64 << 20) - 1, True),  # under 64 MiB left: taken for a full disk
    (OSError(errno.EIO, "Input/output error"), 64 << 20, False),
    (ValueError("a damaged file"), 0, False),  # not a write's error, whatever the space
    (RuntimeError("unexpected pos 64"), None, False),  # the space cannot be read: not said to be full
])
def test_a_full_disk_is_told_by_its_errno_its_words_or_the_space_left(tmp_path, monkeypatch, error, free, full):
    from utils.models import cache_folder

    def usage(path):
        if free is None:
            raise PermissionError(errno.EACCES, "denied")
        return types.SimpleNamespace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    said = cache_folder.full_disk(error, tmp_path)
    assert (said is not None) == full
    if full:
        assert str(said).startswith(f"the disk holding {tmp_path} is full;")


@pytest.mark.parametrize("spec", ["~nosuchuser-specdec/model", "~nosuchuser-specdec/model.gguf"])
def test_an_unknown_users_home_is_one_line(spec):
    with pytest.raises(ModelLoadError, match="~nosuchuser-specdec names no user of this system"):
        model_loader.load_model(spec, device="cpu", progress=False)


def test_an_unknown_users_home_as_the_cache_is_one_line(monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "~nosuchuser-specdec/cache")
    with pytest.raises(ModelLoadError, match="SPECDEC_CACHE_DIR=~nosuchuser-specdec/cache: ~nosuchuser-specdec names no user"):
        model_loader.writable_cache_root()


def test_the_cli_heals_a_prepared_folder_that_lost_its_tokenizer_or_chat_template(tmp_path):
    """Issue 25: without tokenizer.json every prompt encoded to nothing, on every start; without the chat
    template chat mode went silently off."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer=True)
    argv = [sys.executable, "infer.py", "--target", str(gguf), "--drafter", str(gguf), "--device", "cpu",
            "--kernels", "f32", "--json", "--length", "6", "--prompt", "hello world"]
    cache = tmp_path / "cache"

    def run():
        done = subprocess.run(argv, cwd=ROOT, env=env(SPECDEC_CACHE_DIR=str(cache)), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return [json.loads(line)["token_ids"] for line in done.stdout.splitlines()], done.stderr

    answers, _ = run()
    (folder,) = [p for p in cache.iterdir() if p.name.startswith("tiny-") and p.is_dir()]
    for lost in ("tokenizer.json", "chat_template.jinja"):
        (folder / lost).unlink()
        again, stderr = run()
        assert f"the prepared folder {folder} lost {lost}; preparing it again from {gguf}" in stderr
        assert "chat on" in stderr and again == answers  # the same prompt, read and templated as at first
        assert (folder / lost).is_file()


def test_files_written_in_one_step_take_the_umask_as_any_file(tmp_path):
    """mkstemp's 0600 made the stamps, tokenizer pickles and timings of a cache one user prepared unreadable to the
    others sharing it: each of their starts checked, parsed and timed again."""
    import stat

    from utils.models.cache_folder import write_in_one_step

    old = os.umask(0o022)
    try:
        assert write_in_one_step(tmp_path / "shared.json", b"{}")
        os.umask(0o077)
        assert write_in_one_step(tmp_path / "private.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.json", "shared.json"]  # no temporary file left


def test_a_complete_cache_that_cannot_be_written_loads(tmp_path, monkeypatch):
    """A cache prepared once and then mounted read-only (an image, a shared folder) was refused as "cannot be
    written" by every start, though a warm one writes nothing it needs."""
    import torch

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    prepared, _ = model_loader.load_model(str(gguf), device="cpu", progress=False)

    def read_only():
        raise ModelLoadError("the cache folder cannot be written (Read-only file system)")

    monkeypatch.setattr(model_loader, "writable_cache_root", read_only)
    monkeypatch.setattr(prepared_folder, "writable_cache_root", read_only)
    model, _ = model_loader.load_model(str(gguf), device="cpu", progress=False)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, prepared(ids).logits)
    with pytest.raises(ModelLoadError, match="cannot be written"):  # what it lacks still needs a writable cache
        model_loader.load_model(str(write_tiny_gguf(tmp_path / "new.gguf", seed=5, tokenizer=True)), device="cpu",
                                progress=False)


def test_a_cache_in_a_folder_this_user_cannot_enter_is_one_line(tmp_path, monkeypatch):
    """The review's case for the read-only cache: whether the kernels must be built was asked first, and a cache
    inside another user's private folder (PermissionError from `is_file`) was a traceback, not the one line."""
    from pathlib import Path

    from utils.models import qkernels

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "private" / "cache"))
    monkeypatch.delenv("SPECDEC_QKERNELS_DIR", raising=False)
    monkeypatch.setattr(qkernels, "_state", {**qkernels._state, "loaded": False, "why": None})
    real_is_file = Path.is_file

    def private(path):
        if str(path).startswith(str(tmp_path / "private")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_is_file(path)

    monkeypatch.setattr(Path, "is_file", private)
    monkeypatch.setattr(model_loader, "writable_cache_root", lambda: (_ for _ in ()).throw(
        ModelLoadError("the cache folder cannot be written (Permission denied)")))
    assert qkernels.will_build(tmp_path / "private" / "cache")
    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    with pytest.raises(ModelLoadError, match="cannot be written"):
        model_loader.load_model(str(gguf), device="cpu", progress=False)


def test_each_kernel_choice_and_an_int4_drafter_prepare_their_own_folder(source, tmp_path):
    """A folder re-quantised for an int4 drafter or `--kernels int4` is lossy: loaded as a target (the same file,
    another start) it would answer otherwise than the file's own blocks."""
    load, runs = source
    spec = ModelSpec("gguf", str(tmp_path / "m.gguf"))
    forms = [(KERNELS, False), (KERNELS, True), (types.SimpleNamespace(digest="test", override="int4"), False)]
    folders = [native_folder(spec, kernels, int4, progress=False) for kernels, int4 in forms]
    assert len(set(folders)) == 3 and len(runs) == 3
    assert [native_folder(spec, kernels, int4, progress=False) for kernels, int4 in forms] == folders
    assert len(runs) == 3


def test_two_files_of_one_name_keep_their_own_folders(source, tmp_path, capsys):
    """Two models whose files share a name (model-q4_k_m.gguf of two repositories) each keep their prepared
    folder: neither start prepares again, nor removes the other's folder."""
    from gguf_models import write_tiny_gguf

    load, runs = source
    (tmp_path / "elsewhere").mkdir()
    other = write_tiny_gguf(tmp_path / "elsewhere" / "m.gguf", seed=3, tokenizer=True)
    specs = [ModelSpec("gguf", str(tmp_path / "m.gguf")), ModelSpec("gguf", str(other))]
    first = [native_folder(spec, KERNELS, False, progress=False) for spec in specs]
    capsys.readouterr()
    again = [native_folder(spec, KERNELS, False, progress=False) for spec in specs]
    assert first == again and first[0] != first[1] and len(runs) == 2
    assert "preparing it again" not in capsys.readouterr().err


def test_a_prepared_file_this_user_cannot_read_is_prepared_again(tmp_path):
    """`ready` names an unreadable prepared folder ("cannot be read (Permission denied); preparing it again"):
    the start then prepares it again and loads, as for any other damage."""
    from test_model_loader import as_a_user_without_override

    gguf = write_tiny_gguf(tmp_path / "m.gguf", tokenizer=True)
    cache = tmp_path / "cache"
    script = ("import sys; from utils.models.model_loader import load_model\n"
              "load_model(sys.argv[1], device='cpu', kernels='f32', progress=False); print('loaded')")

    def run():
        return subprocess.run(as_a_user_without_override([sys.executable, "-c", script, str(gguf)]), cwd=ROOT,
                              env=env(SPECDEC_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=300)

    done = run()
    assert done.stdout == "loaded\n", done.stderr[-2000:]
    (folder,) = [p for p in cache.iterdir() if p.name.startswith("m-") and p.is_dir()]
    (folder / model_loader.STATE_FILE).chmod(0)
    done = run()
    assert (f"the prepared folder {folder} cannot be read (Permission denied); preparing it again from {gguf}"
            in done.stderr)
    assert done.stdout == "loaded\n", done.stderr[-2000:]
    assert (folder / model_loader.STATE_FILE).stat().st_mode & 0o777 != 0  # a new file, readable


def test_a_write_in_one_step_that_fails_leaves_the_old_file_whole(tmp_path):
    """Stamps, tokenizer pickles, kernel choices and timings are replaced in one step: a write that fails half-way
    (here the file-size limit, as a full disk would) leaves the old file as it was and no temporary file."""
    path = tmp_path / "kernels-0123456789ab.json"
    path.write_bytes(b"o" * 1000)
    script = ("import resource, signal, sys; from pathlib import Path\n"
              "from utils.models.cache_folder import write_in_one_step\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
              "print(write_in_one_step(Path(sys.argv[1]), b'n' * 100000))")
    done = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert (done.stdout, done.stderr) == ("False\n", "")
    assert path.read_bytes() == b"o" * 1000 and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_file_of_several_chunks_is_summed_whole(tmp_path, monkeypatch):
    """The sum runs over every chunk: damage in any but the last would otherwise go unseen (here 4 KB chunks)."""
    import zlib

    monkeypatch.setattr(prepared_folder, "CHUNK", 4096)
    data = os.urandom(3 * 4096 + 5)
    (tmp_path / "state").write_bytes(data)
    assert prepared_folder.checksum(tmp_path / "state") == f"{zlib.crc32(data):08x}"


def publish(tmp_path, monkeypatch, files):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))

    def make(work, out):
        for name, content in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(content)

    return model_loader.publish_folder(tmp_path / "m-folder", "m", "id", make)


def test_a_folder_with_a_subfolder_is_recorded_file_by_file(tmp_path, monkeypatch):
    """A subfolder is no file to sum: its files are recorded, and damage to one is named by its path."""
    folder = publish(tmp_path, monkeypatch, {"config.json": b"{}", "tok/vocab.txt": b"a\nb\n"})
    assert prepared_folder.listed(folder) == ["config.json", "tok/vocab.txt"]
    assert prepared_folder.folder_problem(folder, "id") is None
    (folder / "tok" / "vocab.txt").write_bytes(b"a\nc\n")
    assert prepared_folder.folder_problem(folder, "id").startswith("has tok/vocab.txt changed since it was written")


def test_a_folder_prepared_from_another_source_is_not_taken(tmp_path, monkeypatch):
    """The folder's name comes from the file's name: another file of that name must not load this folder."""
    folder = publish(tmp_path, monkeypatch, {"config.json": b"{}"})
    assert prepared_folder.folder_problem(folder, "id") is None
    assert prepared_folder.folder_problem(folder, "another id") == "was prepared from another source file"
    assert not prepared_folder.sound(folder, "another id")


@pytest.mark.parametrize("record", [{},  # an object, but no earlier version's record: that one named its source
                                    {"version": 2, "sha256": "id"},  # KeyError
                                    {"version": 2, "sha256": "id", "files": {"config.json": 5}},  # TypeError
                                    {"version": 2, "sha256": "id", "files": {"config.json": {"size": "x"}}}])
def test_a_record_missing_its_files_is_no_readable_record(tmp_path, monkeypatch, record):
    folder = publish(tmp_path, monkeypatch, {"config.json": b"{}"})
    (folder / prepared_folder.SOURCE_MARKER).write_text(json.dumps(record))
    assert prepared_folder.folder_problem(folder, "id") == "has no readable record of its files"


def test_an_error_is_judged_once_the_work_folder_is_gone(tmp_path, monkeypatch):
    """A failed preparation's own partial files fill the disk it is judged on: it is removed first, so an error
    that is not the disk's is not called a full disk."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    works = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(
        free=4096 if any(w.exists() for w in works) else 10 << 30))

    def fail(work, out):
        works.append(work)
        out.mkdir()
        (out / "native-state.pt").write_bytes(b"x" * 1000)
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        model_loader.publish_folder(tmp_path / "m-folder", "m", "id", fail)


def test_files_found_intact_stay_stamped_start_after_start(source, monkeypatch):
    """The stamp is written anew at each check: the files it vouched for must stay in it, or every other warm start
    reads them all again."""
    monkeypatch.setattr(prepared_folder, "SETTLED_NS", 0)
    load, runs = source
    folder = load()
    time.sleep(0.05)
    assert load() == folder  # read whole, then stamped
    reads = count_reads(monkeypatch)
    for _ in range(3):
        assert load() == folder
    assert reads == [] and runs == ["m.gguf"]


def test_a_folder_whose_stamp_cannot_be_written_is_still_loaded(source, monkeypatch, capsys):
    """A stamp that cannot be written (a read-only cache; here a folder in its place, as root writes anywhere) costs
    a read of each file per start, never the sound folder itself."""
    monkeypatch.setattr(prepared_folder, "SETTLED_NS", 0)
    load, runs = source
    folder = load()
    (folder / prepared_folder.STAMP).unlink(missing_ok=True)
    (folder / prepared_folder.STAMP).mkdir()
    time.sleep(0.05)
    reads = count_reads(monkeypatch)
    capsys.readouterr()
    assert load() == folder and load() == folder and runs == ["m.gguf"]
    assert sorted(reads) == sorted(prepared_folder.listed(folder) * 2) and capsys.readouterr().err == ""


def test_a_stamp_holds_only_for_the_sum_it_was_checked_against(tmp_path, monkeypatch):
    """A stamp vouches for a file against the recorded sum it was checked with: a record that says otherwise now has
    the file read again, and the line gives the sum found, then the recorded one."""
    monkeypatch.setattr(prepared_folder, "SETTLED_NS", 0)
    folder = publish(tmp_path, monkeypatch, {"config.json": b"{}"})
    time.sleep(0.05)
    assert prepared_folder.folder_problem(folder, "id") is None and (folder / prepared_folder.STAMP).is_file()
    marker = folder / prepared_folder.SOURCE_MARKER
    record = json.loads(marker.read_text())
    found = record["files"]["config.json"]["crc32"]
    record["files"]["config.json"]["crc32"] = "00000000"
    marker.write_text(json.dumps(record))
    assert prepared_folder.folder_problem(folder, "id") == (
        f"has config.json changed since it was written (checksum {found}, not 00000000)")


def test_a_first_start_says_nothing_of_a_folder_not_prepared_yet(tmp_path, capsys):
    # no folder is no damage: a cold start must not print "preparing it again"
    assert prepared_folder.ready(tmp_path / "m-folder", "id", "m.gguf") is False
    assert not prepared_folder.sound(tmp_path / "m-folder", "id")
    assert capsys.readouterr().err == ""


def test_a_folder_without_its_record_is_an_unfinished_conversion(tmp_path, monkeypatch):
    """The record is written last: a folder without one was left by an interrupted run, not unreadable."""
    folder = publish(tmp_path, monkeypatch, {"config.json": b"{}"})
    (folder / prepared_folder.SOURCE_MARKER).unlink()
    assert prepared_folder.folder_problem(folder, "id") == "has no readable record of its files"


def test_a_rename_that_fails_with_nothing_in_place_is_raised(tmp_path, monkeypatch):
    """Only another start's sound folder excuses a failed rename: otherwise the error is raised, not a folder that
    is not there returned; the work folder goes either way."""
    def fail(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(prepared_folder.os, "replace", fail)
    with pytest.raises(OSError, match="cross-device"):
        publish(tmp_path, monkeypatch, {"config.json": b"{}"})
    assert list(tmp_path.iterdir()) == []
