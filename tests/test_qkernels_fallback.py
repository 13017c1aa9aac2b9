"""Without a C++ compiler the integer kernels cannot be built: a GGUF model still loads and answers through
torch's int4 or bfloat16 kernels, with one line saying what is missing (run in a subprocess: the kernels' state
is global). The sources also compile for a CPU without AVX2, where only their portable code is left, and for one
with AVX2 but neither AVX-512 nor VNNI; the build an AVX2-only (or AVX-VNNI) CPU gets runs here and gives this
build's bits."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gguf_models import write_tiny_gguf
from utils.models.qkernels import OTHER_SOURCES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys, torch
from utils.models import qkernels
from utils.models.model_loader import load_model
from utils.models.gguf_native import kernel_counts
model, _ = load_model(sys.argv[1], device="cpu", kernels="auto")
counts = kernel_counts(model)
with torch.no_grad():
    logits = model(torch.tensor([[5, 6, 7]]), use_cache=False).logits
print("loaded", qkernels.loaded(), "kernels", ",".join(sorted(counts)), bool(torch.isfinite(logits).all()))
print(qkernels.describe())
"""


def python_path() -> str:
    """The repository first, then whatever the caller had (wheels installed to a folder of their own, say)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_no_compiler_falls_back_to_torch_kernels_with_one_note(tmp_path):
    from gguf import GGMLQuantizationType as Q

    from gguf_models import TYPES

    # with Q3_K (of Q3_K_M files) too, which only our kernels read as it is: its layers run dequantized, its token
    # embeddings stay the file's blocks, decoded per row by the gguf package
    types = {**TYPES, "token_embd": Q.Q3_K, "ffn_up": Q.Q3_K}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=0, tokenizer=True, types=types)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded False" in done.stdout and done.stdout.splitlines()[0].endswith("True")
    kernels = set(done.stdout.split("kernels", 1)[1].split()[0].split(","))
    # torch's kernels only, int4 where the choice measured it fastest (here; bfloat16 can win on AMX machines)
    assert kernels <= {"int4", "bf16", "f32"}, kernels
    # the start-up line's device part
    assert done.stdout.splitlines()[-1].startswith("no integer kernels: no C++ compiler"), done.stdout
    notes = [line for line in done.stderr.splitlines() if "no C++ compiler" in line]
    assert len(notes) == 1 and "torch's int4" in notes[0] and "Traceback" not in done.stderr
    assert "note: 2 tensors of type Q3_K run dequantized (the integer kernels that read it are not built)" in done.stderr.splitlines()
    assert not list((tmp_path / "cache").glob("qkernels-*"))  # nothing that looks like a finished build


def test_a_start_asks_the_compiler_its_version_once(monkeypatch):
    """`will_build` and `ensure` both key the build on the compiler's version, through `compiler_version`: asked
    twice, it runs `--version` once."""
    import shutil

    from utils.models import qkernels

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    runs = []
    real = subprocess.run
    monkeypatch.setattr(qkernels.subprocess, "run", lambda command, **kw: runs.append(command) or real(command, **kw))
    qkernels.compiler_version.cache_clear()
    first = qkernels.compiler_version("c++")
    assert first and qkernels.compiler_version("c++") == first
    assert runs == [["c++", "--version"]]
    assert qkernels.compiler_version("/no/such/c++") is None  # each command its own answer


CUDA_BUILD_WITHOUT_GPU = """
import sys, torch
torch.cuda._is_compiled = lambda: True  # what a CUDA build of torch says on a machine without a GPU
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: False
if sys.argv[1] == "ours":
    from utils.models import qkernels
    qkernels.import_cpp_extension()
else:
    from torch.utils import cpp_extension
print("imported")
"""


def test_the_build_keeps_torch_s_cuda_warning_off_a_cpu_start(tmp_path):
    """Seen with torch 2.14.1+cu130 on this CPU machine (a CUDA toolkit installed): the first start's lines had
    torch's "No CUDA runtime is found, using CUDA_HOME=…" among them, logged when the build imported
    cpp_extension. Our import leaves it out; torch's own import, the control, still logs it."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "PYTHONPATH": python_path()}
    env.pop("SPECDEC_QKERNELS_VERBOSE", None)
    runs = {who: subprocess.run([sys.executable, "-c", CUDA_BUILD_WITHOUT_GPU, who], capture_output=True, text=True,
                                env=env, cwd=ROOT, timeout=120) for who in ("torch", "ours")}
    assert all(done.stdout == "imported\n" for done in runs.values()), runs
    assert "No CUDA runtime is found" in runs["torch"].stderr
    assert runs["ours"].stderr == ""


def test_kernels_never_tried_are_described_as_unused_not_as_missing():
    # a float32 or Hugging Face model never asks for the kernels: nothing is missing, and no "None" is shown
    done = subprocess.run([sys.executable, "-c", "from utils.models import qkernels; print(qkernels.describe())"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": python_path()}, cwd=ROOT,
                          timeout=120)
    assert done.stdout.strip() == "integer kernels unused (no native GGUF weights)", done.stdout + done.stderr


@pytest.mark.parametrize("source", ["qkernels.cpp", *OTHER_SOURCES])
@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"])
def test_the_sources_compile_for_a_cpu_without_avx2(source, arch):
    """Built for an x86-64 CPU without AVX2 (SSE2 only), every `SPECDEC_AVX2` section falls away and the portable
    code must stand on its own (a type declared only inside such a section once broke that build). x86-64-v3 (AVX2,
    FMA, F16C) keeps the AVX2 sections without the VNNI and AVX-512 ones: the Zen 3's build, which a machine with
    AVX-512 never compiles with -march=native."""
    import platform
    import shutil
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from utils.models.qkernels import SOURCE, compiler_command

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-march=x86-64 names an x86 baseline")
    cxx = shutil.which(compiler_command())
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [flag for path in include_paths() for flag in ("-I", path)] + ["-I", sysconfig.get_paths()["include"]]
    # the standard torch.utils.cpp_extension builds with (2.13 and 2.14); torch 2.14's headers need C++20
    done = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", f"-march={arch}", "-fopenmp", *includes,
                           str(SOURCE.with_name(source))], capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, errors[:5]


OTHER_BUILD = """
import sys, torch
from pathlib import Path
from utils.models import qkernels
from utils.models.gguf_native import build, prepare
from utils.models.kernel_choice import KernelChoice
from utils.models.model_loader import cache_root
assert qkernels.ensure(cache_root()), qkernels.why()
cases = torch.load(sys.argv[1])
out = {"paths": qkernels.paths(), "arch": qkernels.arch_flags(),
       "products": {name: [torch.ops.specdec.gguf_mm(xq, w, kind, cols, p) for p in qkernels.paths()]
                    for name, (xq, w, kind, cols) in cases["products"].items()}, "logits": {}}
for kernels in ("gguf", "gguf8"):
    model = build(*prepare(Path(cases["gguf"]), KernelChoice(None, kernels), False))
    with torch.no_grad():
        out["logits"][kernels] = model(cases["ids"], use_cache=False).logits
out["path_flags"] = list(torch.ops.specdec.path_flags())
flags = qkernels.cpu_flags()
qkernels.cpu_flags = lambda: flags - {"avx_vnni"} | {"avx512_vnni", "avx512vl"}  # AVX-512 VNNI alone (Zen 4)
out["unrunnable_without_avx_vnni"] = qkernels.unrunnable_paths()
torch.save(out, sys.argv[2])
"""


def product_cases() -> dict:
    """{name: (activations, blocks, gguf_mm's type, in_features)}: every type the kernels read, as in the file and
    interleaved, at widths that take each tile size (1, 4, 8 rows) and their remainders."""
    import torch

    from utils.models import qkernels
    from utils.models.gguf_blocks import BLOCK_LAYOUT, synthetic_blocks

    cases, g = {}, torch.Generator().manual_seed(7)
    for type_name in sorted(qkernels.TYPES):
        cols = 512 if BLOCK_LAYOUT[type_name][0] == 256 else 160
        raw = synthetic_blocks(type_name, 24, cols, scale=0.05, generator=g)
        for rows in (1, 5, 13):
            xq = qkernels.quantize(torch.randn(rows, cols, generator=g) * 3, type_name)
            cases[f"{type_name} {rows}"] = (xq, raw.data, qkernels.TYPES[type_name], cols)
            if type_name in qkernels.X8:
                w8 = torch.ops.specdec.interleave(raw.data, qkernels.TYPES[type_name])
                cases[f"{type_name}x8 {rows}"] = (xq, w8, qkernels.X8[type_name], cols)
    return cases


def test_the_build_of_an_avx2_cpu_gives_this_builds_bits(tmp_path):
    """The kernels built as an AVX2-only CPU gets them (`-march=x86-64-v3`: 16 vector registers, no AVX-512), or
    with AVX-VNNI where this CPU has it (as recent consumer Intel CPUs do, without AVX-512), run in a subprocess
    here: every product on every path they compile, and a tiny model's logits with the file's layout and with 8
    rows interleaved, bit for bit this build's. On an AVX-512 machine nothing else runs that code."""
    import torch

    from utils.models import qkernels
    from utils.models.gguf_native import build, prepare
    from utils.models.kernel_choice import KernelChoice
    from utils.models.model_loader import cache_root

    flags = qkernels.cpu_flags()
    if not {"avx2", "fma"} <= flags:  # the AVX2 path's instructions
        pytest.skip("this CPU cannot run an AVX2 build")
    assert qkernels.ensure(cache_root()), qkernels.why()
    arch, paths = ("-march=x86-64-v3 -mavxvnni", [0, 1, 2]) if "avx_vnni" in flags else ("-march=x86-64-v3", [0, 1])
    cases = {"products": product_cases(), "gguf": str(write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=5)),
             "ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]])}
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "PYTHONPATH": python_path(), "SPECDEC_QKERNELS_ARCH": arch,
           "SPECDEC_QKERNELS_DIR": str(tmp_path / "build"), "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", OTHER_BUILD, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    other = torch.load(tmp_path / "out.pt")
    assert other["paths"] == paths and other["arch"] == arch.split()
    assert len(list((tmp_path / "build").glob("qkernels-*"))) == 1  # built there, not this build loaded again
    if 2 in paths:
        # its dpbusd is AVX-VNNI's VEX form: a CPU with AVX-512 VNNI alone (Zen 4, Ice Lake) raises #UD on it, and
        # the check had let it load there (either VNNI flag passed)
        assert other["path_flags"][2].split()[-1] == "avx_vnni"
        assert other["unrunnable_without_avx_vnni"] == qkernels.PATHS[2]
    for name, (xq, w, kind, cols) in cases["products"].items():
        ours = torch.ops.specdec.gguf_mm(xq, w, kind, cols, 0)
        for path, y in zip(other["paths"], other["products"][name]):
            assert torch.equal(y, ours), f"{name}: {qkernels.PATHS[path]} of the {arch} build differs"
    for kernels, theirs in other["logits"].items():
        model = build(*prepare(Path(cases["gguf"]), KernelChoice(None, kernels), False))
        with torch.no_grad():
            assert torch.equal(theirs, model(cases["ids"], use_cache=False).logits), kernels


def test_a_build_for_a_cpu_this_one_is_not_is_refused_in_one_line(monkeypatch):
    """`$SPECDEC_QKERNELS_ARCH` naming more than this CPU has would end the process at the first product (SIGILL):
    the paths it cannot run are named, and `ensure` then leaves the kernels unused (torch's run instead)."""
    import platform

    import torch

    from utils.models import qkernels
    from utils.models.model_loader import cache_root

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 paths")
    assert qkernels.ensure(cache_root()), qkernels.why()
    assert qkernels.unrunnable_paths() == ""  # this machine's own build
    needs = [set(flags.split()) for flags in torch.ops.specdec.path_flags()]
    assert len(needs) == len(qkernels.paths()) and all(need <= qkernels.cpu_flags() for need in needs)
    monkeypatch.setenv("SPECDEC_QKERNELS_ARCH", "-march=x86-64-v3")
    monkeypatch.setattr(qkernels, "cpu_flags", lambda: {"avx2", "fma"})  # an AVX2-only CPU
    assert qkernels.unrunnable_paths() == ", ".join(qkernels.PATHS[p] for p in qkernels.paths() if p >= 2)
    monkeypatch.setattr(qkernels, "cpu_flags", lambda: set())  # SSE only
    beyond_sse = ", ".join(qkernels.PATHS[p] for p in qkernels.paths() if p >= 1)
    assert qkernels.unrunnable_paths() == beyond_sse
    # ensure() in a process of its own (the kernels' state is global): `-march=native` names this build, so it
    # loads without compiling, then is refused as if this CPU had SSE only
    script = ("from utils.models import qkernels; from utils.models.model_loader import cache_root\n"
              "qkernels.cpu_flags = lambda: set()\n"
              "print(qkernels.ensure(cache_root(), progress=False)); print(qkernels.why())")
    env = {**os.environ, "PYTHONPATH": python_path(), "SPECDEC_QKERNELS_ARCH": "-march=native"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "False", f"built for a CPU with {beyond_sse} ($SPECDEC_QKERNELS_ARCH), which this one lacks"]


PROBE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor fail(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(n < 0, "n must be negative, got ", n);
  return x;
}
TORCH_LIBRARY(specdec_link_probe, m) { m.def("fail(Tensor x, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(specdec_link_probe, CPU, m) { m.impl("fail", &fail); }
"""
PROBE_SCRIPT = """
import sys, torch
from torch.utils import cpp_extension
from utils.models import qkernels
cpp_extension.load(name="specdec_link_probe", sources=[sys.argv[1]], build_directory=sys.argv[2],
                   is_python_module=False, extra_cflags=["-O1"],
                   extra_ldflags=[sys.argv[3], *qkernels.link_flags()])
try:
    torch.ops.specdec_link_probe.fail(torch.zeros(1), 7)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the GNU toolchain's static C++ runtime")
def test_our_ops_format_errors_with_the_process_s_cpp_runtime_even_where_the_compiler_links_it_statically(tmp_path):
    """On a GPU image whose compiler's `-lstdc++` found only the static archive (CXX=/opt/gcc/bin/g++, its
    libstdc++.so link pointing nowhere), our library carried a second copy of libstdc++'s streams: a failing
    TORCH_CHECK crashed there with SIGSEGV, and here the same copy loses the number the message formats ("got "
    for "got 7"). `link_flags()` names the shared runtime first; `-static-libstdc++` stands in for that image."""
    import shutil

    from utils.models import qkernels

    if shutil.which(qkernels.compiler_command()) is None:
        pytest.skip("no C++ compiler")
    runtime = [flag for flag in qkernels.link_flags() if flag.endswith("libstdc++.so.6")]
    assert len(runtime) == 1 and Path(runtime[0]).is_absolute() and Path(runtime[0]).is_file(), qkernels.link_flags()
    source, build = tmp_path / "probe.cpp", tmp_path / "build"
    source.write_text(PROBE)
    build.mkdir()
    env = {**os.environ, "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(source), str(build), "-static-libstdc++"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "raised: n must be negative, got 7" in done.stdout, done.stdout


def test_a_build_cut_short_stops_the_compilers_it_started(tmp_path, monkeypatch):
    """A sweep: SIGTERM or Ctrl-C to the program (not its process group) during the first start's build ended ninja
    but left its three `cc1plus` compiling for their full time after the program had gone. Here a stand-in compiler
    works in the build folder, as ninja's do, when the build is cut short."""
    from torch.utils import cpp_extension

    from utils.models import qkernels

    if not Path("/proc/self/cwd").exists():
        pytest.skip("the compilers are found through Linux's /proc")
    compilers = []

    def cut_short(*, build_directory, **kwargs):
        compilers.append(subprocess.Popen(["sleep", "60"], cwd=build_directory))
        time.sleep(0.2)
        raise KeyboardInterrupt

    monkeypatch.setattr(cpp_extension, "load", cut_short)
    with pytest.raises(KeyboardInterrupt):
        qkernels.build(tmp_path / "cache", tmp_path / "cache" / "qkernels-x", progress=False)
    assert compilers[0].wait(timeout=10) == -signal.SIGTERM
    assert not list((tmp_path / "cache").iterdir())  # the work folder removed, nothing that looks built


@pytest.mark.parametrize("damage", ["not a library", "truncated"])
def test_a_damaged_cached_build_is_built_again(tmp_path, damage):
    """A kernel library damaged on disk failed to load on every start (dlopen refused it; the note blamed a build
    that never ran), or, truncated, ended the process with SIGBUS inside dlopen. It is built again, once (the build
    stands in here: a copy of this machine's library)."""
    from utils.models import qkernels
    from utils.models.model_loader import cache_root

    assert qkernels.ensure(cache_root()), qkernels.why()
    cxx = qkernels.compiler_command()
    _, good = qkernels.library_path(cache_root(), qkernels.compiler_version(cxx), cxx)
    damaged_dir = tmp_path / "kernels"
    damaged = damaged_dir / good.parent.name / good.name  # where that process looks: the key is this build's
    damaged.parent.mkdir(parents=True)
    if damage == "truncated":  # its build wrote the whole library's digest beside it
        damaged.write_bytes(good.read_bytes()[:4096])
        damaged.with_name(damaged.name + ".sha256").write_text(qkernels.file_digest(good) + "\n")
    else:
        damaged.write_bytes(b"\0" * 4096)
    script = ("import shutil, sys, torch\nfrom pathlib import Path\nfrom utils.models import qkernels\n"
              "def build(cache_dir, folder, progress=True, cxx=None):\n"
              "    print('built')\n"
              "    shutil.copytree(sys.argv[1], folder)\n"
              "    torch.ops.load_library(str(Path(folder) / sys.argv[2]))  # as cpp_extension loads what it built\n"
              "qkernels.build = build\n"
              "print(qkernels.ensure(Path(sys.argv[3]), progress=False), qkernels.why())\n")
    env = {**os.environ, "PYTHONPATH": python_path(), "SPECDEC_QKERNELS_DIR": str(damaged_dir)}
    done = subprocess.run([sys.executable, "-c", script, str(good.parent), good.name, str(damaged_dir)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["built", "True None"]
    assert damaged.read_bytes() == good.read_bytes()


def test_a_build_keeps_its_library_s_digest_beside_it(tmp_path, monkeypatch):
    """What `load_cached` checks before dlopen (the compile stands in here: it writes a library of 3 bytes)."""
    from types import SimpleNamespace

    from utils.models import qkernels

    def load(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_bytes(b"abc")

    monkeypatch.setattr(qkernels, "import_cpp_extension", lambda: SimpleNamespace(load=load))
    folder = tmp_path / "qkernels-key"
    qkernels.build(tmp_path, folder, progress=False)
    library = folder / f"{qkernels.NAME}.so"
    assert (folder / f"{qkernels.NAME}.so.sha256").read_text() == qkernels.file_digest(library) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qkernels-key"]  # the work folder is gone
