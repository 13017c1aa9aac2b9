"""Without a C++ compiler the integer kernels cannot be built: a GGUF model still loads and answers through
torch's int4 or bfloat16 kernels, with one line saying what is missing (run in a subprocess: the kernels' state
is global). The sources also compile for a CPU without AVX2, where only their portable code is left."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_models import write_tiny_gguf

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
"""


def python_path() -> str:
    """The repository first, then whatever the caller had (wheels installed to a folder of their own, say)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_no_compiler_falls_back_to_torch_kernels_with_one_note(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", seed=0, tokenizer=True)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": python_path()}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded False" in done.stdout and "True" in done.stdout.split()[-1]
    kernels = set(done.stdout.split("kernels", 1)[1].split()[0].split(","))
    # torch's kernels only, int4 where the choice measured it fastest (here; bfloat16 can win on AMX machines)
    assert kernels <= {"int4", "bf16", "f32"}, kernels
    notes = [line for line in done.stderr.splitlines() if "no C++ compiler" in line]
    assert len(notes) == 1 and "torch's int4" in notes[0] and "Traceback" not in done.stderr
    assert not list((tmp_path / "cache").glob("qkernels-*"))  # nothing that looks like a finished build


@pytest.mark.parametrize("source", ["qkernels.cpp", "matmul.cpp"])
def test_the_sources_compile_for_a_cpu_without_avx2(source):
    """Built for an x86-64 CPU without AVX2 (SSE2 only), every `SPECDEC_AVX2` section falls away and the portable
    code must stand on its own (a type declared only inside such a section once broke that build)."""
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
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-march=x86-64", "-fopenmp", *includes,
                           str(SOURCE.with_name(source))], capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, errors[:5]


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
