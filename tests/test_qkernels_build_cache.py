"""The kernels' build on first use (`utils/models/qkernels`): where a build goes and what it is keyed on, when it is
built again or not, and how a build in a temporary folder reaches its place. The compiler stands in throughout
(nothing compiles here): tests found missing by a mutation review."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from utils.models import qkernels

LIBRARY = f"{qkernels.NAME}.so"


@pytest.fixture
def fresh(monkeypatch):
    """The kernels neither loaded nor refused, one compiler that answers, no shared build folder, nothing registered
    or checked after a load (the library this process loaded already, if any, stays as it is)."""
    monkeypatch.setattr(qkernels, "_state", {"loaded": False, "why": None, "key": None, "ops": None})
    monkeypatch.delenv("SPECDEC_QKERNELS_DIR", raising=False)
    monkeypatch.delenv("SPECDEC_QKERNELS", raising=False)
    monkeypatch.setattr(qkernels, "compiler_version", lambda cxx: "c++ (a compiler never used before) 99")
    monkeypatch.setattr(qkernels, "register_fakes", lambda: None)
    monkeypatch.setattr(qkernels, "unrunnable_paths", lambda: "")


def fake_load(name, build_directory, **kwargs):
    """cpp_extension.load as the tests see it: a library of three bytes where ninja would have linked one."""
    (Path(build_directory) / f"{name}.so").write_bytes(b"abc")


def test_a_build_goes_to_the_shared_build_folder_with_its_key(tmp_path, monkeypatch, fresh):
    """`$SPECDEC_QKERNELS_DIR` holds the build (its lock, its temporary folder, its place), not the model cache
    `ensure` was given; the folder is named by the build's key, which `key()` then gives."""
    shared, models = tmp_path / "shared", tmp_path / "models"
    monkeypatch.setenv("SPECDEC_QKERNELS_DIR", str(shared))
    builds = []
    monkeypatch.setattr(qkernels, "load_cached", lambda library: False)
    monkeypatch.setattr(qkernels, "build", lambda cache_dir, folder, progress=True, cxx=None: builds.append(
        (cache_dir, folder)))
    key = qkernels.build_key(qkernels.compiler_version("c++"), qkernels.compiler_command())
    assert qkernels.ensure(models, progress=False) is True
    assert builds == [(shared, shared / f"qkernels-{key}")]
    assert qkernels.key() == key and qkernels.loaded()
    assert not models.exists()


def test_a_build_loaded_from_the_cache_is_marked_used(tmp_path, monkeypatch, fresh):
    """`cache_prune` removes what no start used for long, by modification time: a start that loads the build marks
    its folder used, so the one build every start loads is not pruned as unused."""
    import time

    cxx = qkernels.compiler_command()
    _, library = qkernels.library_path(tmp_path, qkernels.compiler_version(cxx), cxx)
    library.parent.mkdir(parents=True)
    library.write_bytes(b"abc")
    long_ago = time.time() - 90 * 86400
    os.utime(library.parent, (long_ago, long_ago))
    monkeypatch.setattr(qkernels, "load_cached", lambda path: path == library)
    monkeypatch.setattr(qkernels, "build", lambda *args, **kwargs: pytest.fail("built though cached"))
    assert qkernels.ensure(tmp_path, progress=False) is True
    assert library.parent.stat().st_mtime > long_ago + 80 * 86400


def test_an_ensure_after_a_load_neither_loads_nor_builds_again(tmp_path, monkeypatch, fresh):
    """Every GGUF load asks `ensure`: once loaded, the answer is kept (no second digest of the library, dlopen or
    registration of the fakes), whatever happened to the cache meanwhile."""
    monkeypatch.setattr(qkernels, "load_cached", lambda library: True)
    assert qkernels.ensure(tmp_path, progress=False) is True
    monkeypatch.setattr(qkernels, "load_cached", lambda library: pytest.fail("loaded again"))
    monkeypatch.setattr(qkernels, "build", lambda *args, **kwargs: pytest.fail("built again"))
    monkeypatch.setattr(qkernels, "register_fakes", lambda: pytest.fail("registered again"))
    assert qkernels.ensure(tmp_path, progress=False) is True and qkernels.why() is None


def test_a_build_another_start_finished_while_this_one_waited_is_loaded_not_built_again(tmp_path, monkeypatch,
                                                                                        fresh):
    answers = iter([False, True])  # none before the lock; after it, the other start's
    monkeypatch.setattr(qkernels, "load_cached", lambda library: next(answers))
    monkeypatch.setattr(qkernels, "build", lambda *args, **kwargs: pytest.fail("built again"))
    assert qkernels.ensure(tmp_path, progress=False) is True


def test_a_failed_build_is_not_tried_again_in_the_same_process(tmp_path, monkeypatch, fresh):
    tries = []

    def failing_build(*args, **kwargs):
        tries.append(args)
        raise RuntimeError("qkernels.cpp:1:1: error: no such thing")

    monkeypatch.setattr(qkernels, "load_cached", lambda library: False)
    monkeypatch.setattr(qkernels, "build", failing_build)
    assert qkernels.ensure(tmp_path, progress=False) is False
    first = qkernels.why()
    assert qkernels.ensure(tmp_path, progress=False) is False and qkernels.will_build(tmp_path) is False
    assert len(tries) == 1 and qkernels.why() == first


def test_will_build_says_whether_ensure_would_compile(tmp_path, monkeypatch, fresh):
    assert qkernels.will_build(tmp_path) is True  # nothing built there yet
    cxx = qkernels.compiler_command()
    _, library = qkernels.library_path(tmp_path, qkernels.compiler_version(cxx), cxx)
    library.parent.mkdir(parents=True)
    library.write_bytes(b"abc")
    assert qkernels.will_build(tmp_path) is False  # built already
    library.unlink()
    monkeypatch.setattr(qkernels, "_state", {**qkernels._state, "loaded": True})
    assert qkernels.will_build(tmp_path) is False  # loaded already (from another folder)
    monkeypatch.setattr(qkernels, "_state", {**qkernels._state, "loaded": False})
    monkeypatch.setattr(qkernels, "compiler_version", lambda cxx: None)
    assert qkernels.will_build(tmp_path) is False  # no compiler: nothing to wait for


def test_the_build_folder_is_named_by_its_key(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_QKERNELS_DIR", raising=False)
    cxx = qkernels.compiler_command()
    key_1, one = qkernels.library_path(tmp_path, "c++ 1.0", cxx)
    key_2, two = qkernels.library_path(tmp_path, "c++ 2.0", cxx)
    assert one == tmp_path / f"qkernels-{key_1}" / LIBRARY and two == tmp_path / f"qkernels-{key_2}" / LIBRARY
    assert key_1 != key_2


def test_the_build_key_names_every_source_and_header_the_arch_and_python(tmp_path, monkeypatch):
    """A changed header or kernel source, another `$SPECDEC_QKERNELS_ARCH` (-march=x86-64-v3 for an AVX2 CPU) or
    another Python each need their own build: one kept under the old key would be loaded as it is."""
    sources = tmp_path / "qkernels"
    shutil.copytree(qkernels.SOURCE.parent, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(qkernels, "SOURCE", sources / qkernels.SOURCE.name)
    monkeypatch.delenv("SPECDEC_QKERNELS_ARCH", raising=False)

    def key():
        return qkernels.build_key("c++ 1.0", "c++")

    keys = [key()]
    for name in (qkernels.HEADERS[0], qkernels.HEADERS[-1], qkernels.OTHER_SOURCES[0], qkernels.OTHER_SOURCES[-1],
                 qkernels.SOURCE.name):
        with open(sources / name, "a") as file:
            file.write("\n// changed\n")
        keys.append(key())
    monkeypatch.setenv("SPECDEC_QKERNELS_ARCH", "-march=x86-64-v3")
    keys.append(key())
    monkeypatch.setattr(sys, "version", "0.0.1 (another Python)")
    keys.append(key())
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("digest", ["none", "matching", "other", "undecodable"])
def test_a_cached_library_is_loaded_unless_its_digest_differs(tmp_path, monkeypatch, digest):
    """A build from before the digests (none beside it) is left to dlopen; a digest that differs from the bytes
    (a truncated library) means building again, without dlopen. A digest file of bytes that are no text raised a
    UnicodeDecodeError, which `ensure` took for a failed build at every start, never building again."""
    import torch

    loads = []
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    library = tmp_path / LIBRARY
    library.write_bytes(b"abc")
    if digest != "none":
        text = qkernels.file_digest(library).encode() if digest == "matching" else b"0" * 64
        library.with_name(LIBRARY + ".sha256").write_bytes(b"\xff\xfe" if digest == "undecodable" else text + b"\n")
    assert qkernels.load_cached(library) is (digest in ("none", "matching"))
    assert loads == ([str(library)] if digest in ("none", "matching") else [])


def test_a_library_dlopen_refuses_is_not_loaded(tmp_path, monkeypatch):
    import torch

    def refuse(path):
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(torch.ops, "load_library", refuse)
    (tmp_path / LIBRARY).write_bytes(b"abc")
    assert qkernels.load_cached(tmp_path / LIBRARY) is False


def test_a_build_is_renamed_into_place_not_copied(tmp_path, monkeypatch):
    """The finished library reaches its folder in one step (a rename keeps the file: its inode is the one the
    build's digest was taken of), so a start killed meanwhile leaves nothing that looks finished."""
    inodes = []
    real_digest = qkernels.file_digest
    monkeypatch.setattr(qkernels, "file_digest", lambda path: inodes.append(os.stat(path).st_ino) or real_digest(path))
    monkeypatch.setattr(qkernels, "import_cpp_extension", lambda: SimpleNamespace(load=fake_load))
    folder = tmp_path / "qkernels-key"
    qkernels.build(tmp_path, folder, progress=False)
    assert inodes == [os.stat(folder / LIBRARY).st_ino]


def test_a_build_another_start_placed_first_is_kept(tmp_path, monkeypatch):
    """Two starts that built at once: the second's rename fails on the first's folder, whose library it keeps."""
    monkeypatch.setattr(qkernels, "import_cpp_extension", lambda: SimpleNamespace(load=fake_load))
    folder = tmp_path / "qkernels-key"
    folder.mkdir()
    (folder / LIBRARY).write_bytes(b"the other start's")
    (folder / (LIBRARY + ".sha256")).write_text("its digest\n")
    path = os.environ.get("PATH")
    qkernels.build(tmp_path, folder, progress=False)
    assert (folder / LIBRARY).read_bytes() == b"the other start's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qkernels-key"]  # this build's work folder is gone
    assert os.environ.get("PATH") == path  # ninja's folder is on PATH for the build alone


def test_a_rename_that_fails_with_no_build_in_place_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(qkernels, "import_cpp_extension", lambda: SimpleNamespace(load=fake_load))
    folder = tmp_path / "qkernels-key"
    folder.mkdir()
    (folder / "something else").write_text("")  # a folder not empty, no library: the rename fails
    with pytest.raises(OSError):
        qkernels.build(tmp_path, folder, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qkernels-key"]


def test_a_build_restores_path_also_when_the_compile_fails(tmp_path, monkeypatch):
    def failing_load(**kwargs):
        raise RuntimeError("error: no such thing")

    monkeypatch.setattr(qkernels, "import_cpp_extension", lambda: SimpleNamespace(load=failing_load))
    path = os.environ.get("PATH")
    with pytest.raises(RuntimeError):
        qkernels.build(tmp_path, tmp_path / "qkernels-key", progress=False)
    assert os.environ.get("PATH") == path


def test_stop_compilers_stops_those_working_in_the_build_folder_only(tmp_path, monkeypatch):
    """Processes whose folder is the build's or inside it; not one in a folder whose name merely begins as the
    build's does (another start's build), nor this process itself. Signals are recorded, not sent."""
    if not Path("/proc/self/cwd").exists():
        pytest.skip("the compilers are found through Linux's /proc")
    work = tmp_path / "work"
    inside, sibling = work / "sub", tmp_path / "work-of-another-start"
    for folder in (inside, sibling):
        folder.mkdir(parents=True)
    started = {name: subprocess.Popen(["sleep", "60"], cwd=folder)
               for name, folder in (("work", work), ("inside", inside), ("sibling", sibling))}
    sent = []
    try:
        with monkeypatch.context() as patch:
            patch.setattr(qkernels.os, "kill", lambda pid, sig: sent.append(pid))
            patch.chdir(work)  # this process works there too
            qkernels.stop_compilers(work)
    finally:
        for process in started.values():
            process.kill()
            process.wait()
    assert started["work"].pid in sent and started["inside"].pid in sent
    assert started["sibling"].pid not in sent and os.getpid() not in sent


def test_a_compiler_whose_version_fails_is_no_compiler(tmp_path):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fake c++ 1.0'\nexit 1\n")
    fake.chmod(0o755)
    assert qkernels.compiler_version(str(fake)) is None
    good = tmp_path / "good-c++"
    good.write_text("#!/bin/sh\necho 'fake c++ 1.0'\n")
    good.chmod(0o755)
    assert qkernels.compiler_version(str(good)) == "fake c++ 1.0"
