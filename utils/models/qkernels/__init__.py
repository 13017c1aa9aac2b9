"""Our integer kernels for GGUF blocks (`qkernels.cpp`), built for the CPU at hand on first use.

Torch has no kernel that multiplies by a GGUF block as it is; `qkernels.cpp` does, with 8-bit activations and
integer dot products (AVX2, AVX-VNNI, AVX-512 VNNI, AMX's tile unit for wide products, or portable C++). It is
compiled with `-march=native` by `torch.utils.cpp_extension` (ninja), once per source, compiler, torch version and
CPU, into the cache directory: built in a temporary folder, renamed into place, so a killed build leaves nothing
that looks finished. Later starts load the built library without compiling.

`SPECDEC_QKERNELS_ARCH` replaces `-march=native` (`arch_flags`).

No compiler, or a failed build: `ensure()` returns False, `why()` says why in one line, and GGUF models run
through torch's int4 kernel as before. `SPECDEC_QKERNELS=off` does the same on purpose.

The ops, registered with torch.library (so they compose with the model and with torch.compile):
- `torch.ops.specdec.quantize_q8(x [rows, in] float32, path=-1) -> [rows, in / 32 * 44] uint8`: 8-bit activation
  blocks for the legacy types; `quantize_q8k` -> [rows, in / 256 * 320] for the K-quants (`K_TYPES`). `path` 0:
  plain C++, else AVX2 where built (the same bytes).
- `torch.ops.specdec.gguf_mm(xq, blocks [out, row_bytes] uint8, type, in_features, path=-1) -> [rows, out]`.
- `torch.ops.specdec.interleave(blocks [out, row bytes], type) -> [out, ...]`: rows of a type of `X8` (out a
  multiple of 8) in the layout `gguf_mm` reads as type `X8[type name]` (Q3_K, Q4_K, Q5_K: 4 bytes a block of a row
  more than the file's, their scales decoded, IQ4_XS: 2; the others: the same shape); `deinterleave(..., type)` gives the
  file's bytes back.
- `torch.ops.specdec.paths() -> [int]`: the code paths compiled in (0 portable, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI,
  4 AMX: AVX-512's tiles and, from 8 activation rows (Q4_K_X8), 16 (Q6_K_X8) or 12 (Q4_1_X8), the tile unit; listed
  where Linux grants it; `SPECDEC_AMX=off` leaves it out).
- `torch.ops.specdec.attn_in(...)` and `attn_out_mlp(...)`: a decoder layer's two halves around attention, fused
  (`layer.h`; used by `utils/models/lean_forward.py`).
- `torch.ops.specdec.attention(q [batch, heads, rows, dim], k, v [batch, kv heads, n, dim], scale) -> [batch,
  rows, heads, dim]`: causal attention query row by query row, float32 (`attention.h`; used by
  `utils/models/rowwise_attention.py`); `attention_portable(...)`: the same bits from the plain C++ loops (tests).
- `torch.ops.specdec.decoder_stack(...)`: every decoder layer of a pass in one op, keys and values written into the
  cache's buffers (`stack.h`; used by `utils/models/lean_forward.py`).
- `torch.ops.specdec.embedding_rows(table [vocab, row bytes] uint8, type, cols, ids) -> [ids.numel(), cols]`: the
  looked-up rows of an embedding table kept as blocks, float32, the bits of `gguf_blocks.dequantize` (`embedding.h`;
  used by `utils/models/native_linear.GGUFEmbedding`).
- `torch.ops.specdec.requantize_q4_1(blocks [out, row bytes] uint8, type, cols) -> [out, cols / 32 * 20]`: a weight's
  blocks re-quantised to Q4_1, the bits of `native_linear.q4_1_reference` (`requantize.h`; a drafter's preparation).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("qkernels.cpp")  # the ops (torch's tensor headers)
# compiled beside SOURCE by ninja (the kernels, without torch's tensor headers: five compiles side by side)
OTHER_SOURCES = ("tiles_k.cpp", "tiles_x8.cpp", "tiles_legacy.cpp", "matmul.cpp")  # the longest compiles first
# included by the sources: part of what a build is keyed on
HEADERS = ("common.h", "amx.h", "iq_grids.h", "legacy.h", "kquants.h", "interleaved.h", "avx512.h", "matmul.h",
           "layer.h", "attention.h", "stack.h", "embedding.h", "requantize.h", "tiles.h", "aten_ops.h")
NAME = "specdec_qkernels"
PATHS = {0: "portable", 1: "AVX2", 2: "AVX-VNNI", 3: "AVX512-VNNI", 4: "AMX"}
# GGML type ids the kernels read (gguf.GGMLQuantizationType), and the activation block's bytes.
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
         "IQ4_XS": 23, "IQ1_M": 29}
# read against 256-value activation blocks (quantize_q8k): the K-quants, IQ4_XS and the IQ grid types
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S",
           "IQ1_M"}
# Ours: 8 rows interleaved (interleaved.h), made by `interleave`: {file type: the type gguf_mm reads}, the
# activations those of the file type (quantize_q8k for the K-quants, quantize_q8 for Q4_1 and Q8_0).
X8 = {"Q2_K": 110, "Q3_K": 111, "Q4_K": 112, "Q5_K": 113, "Q6_K": 114, "IQ4_XS": 123, "Q4_1": 103, "Q8_0": 108}
# bytes a block of a row: the file's, interleaved
X8_ROW_BYTES = {"Q2_K": (84, 84), "Q3_K": (110, 114), "Q4_K": (144, 148), "Q5_K": (176, 180), "Q6_K": (210, 210),
                "IQ4_XS": (136, 138), "Q4_1": (20, 20), "Q8_0": (34, 34)}
ACTIVATION_BLOCK_BYTES = 44  # per 32 values (quantize_q8)
K_ACTIVATION_BLOCK_BYTES = 320  # per 256 values (quantize_q8k)

_state: dict = {"loaded": False, "why": None, "key": None, "ops": None}


def ops():
    """The op namespace the model calls on its hot path: this build's `torch.ops.specdec`, or the one `use_ops`
    set (`python -m benchmarks.kernel_ab` switches a loaded model between two builds in one process)."""
    return _state["ops"] or torch.ops.specdec


def use_ops(namespace=None) -> None:
    """Route `ops()` to another build's op namespace (None: back to this build's)."""
    _state["ops"] = namespace


def compile_flags() -> list[str]:
    return ["-O3", *arch_flags(), "-ffp-contract=off", "-fopenmp"]


def compiler_command() -> str:
    """The C++ compiler torch.utils.cpp_extension builds with: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def link_flags(cxx: str | None = None) -> list[str]:
    """-fopenmp (torch's thread pool is OpenMP in our translation unit), and on Linux the C++ runtime named as the
    shared library the rest of the process uses. On a GPU image (Ubuntu 24.04, CXX=/opt/gcc/bin/g++, a relocated
    gcc 13.3 whose libstdc++.so link pointed nowhere) `-lstdc++` took the static archive, so our library carried a
    second copy of the stream and locale code: the first error message an op formatted (TORCH_CHECK) looked up a
    facet of the process's locale by that copy's ids and crashed (SIGSEGV) instead of raising."""
    runtime = _shared_libstdcxx(cxx or compiler_command())
    return ["-fopenmp", *([runtime] if runtime else [])]


@functools.lru_cache(maxsize=None)
def _shared_libstdcxx(cxx: str) -> str | None:
    if platform.system() != "Linux":
        return None
    try:
        done = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = done.stdout.strip()  # the bare name back when the compiler has no such file (clang with libc++, say)
    return found if done.returncode == 0 and os.path.isabs(found) and os.path.isfile(found) else None


def arch_flags() -> list[str]:
    """The CPU the build is for: this one (x86 compilers take -march=native, Arm's -mcpu=native), or the flags
    of `$SPECDEC_QKERNELS_ARCH` (`-march=x86-64-v3` builds what an AVX2-only CPU runs, on any later one: how the
    tests check that build on a machine with AVX-512). Part of the build's key, so each gets its own folder."""
    return arch_override() or (
        ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=native"])


def arch_override() -> list[str]:
    return shlex.split(os.environ.get("SPECDEC_QKERNELS_ARCH", ""))  # [] where unset


@functools.lru_cache(maxsize=None)  # asked by `will_build` and again by `ensure`: one `--version` run per start
def compiler_version(cxx: str) -> str | None:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else None


def build_key(compiler: str, cxx: str | None = None) -> str:
    from utils.models.kernel_choice import cpu_facts

    sources = [SOURCE.read_text()] + [SOURCE.with_name(name).read_text() for name in OTHER_SOURCES + HEADERS]
    facts = [*sources, compiler, torch.__version__, sys.version.split()[0], *compile_flags(), *link_flags(cxx),
             repr(cpu_facts())]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def ensure(cache_dir: Path, progress: bool = True) -> bool:
    """Loads the kernels, building them first if this machine has no build yet; False (and `why()`) if it cannot.
    The build goes to `cache_dir`, or to `$SPECDEC_QKERNELS_DIR` where set (one build shared by several model
    caches: the test suite's many temporary ones)."""
    from utils.models.cache_folder import mark_used, one_start_at_a_time, remove

    if _state["loaded"]:
        return True
    if _state["why"] is not None:
        return False
    if os.environ.get("SPECDEC_QKERNELS", "").lower() == "off":
        return _fail("disabled by SPECDEC_QKERNELS=off")
    cxx = compiler_command()
    compiler = compiler_version(cxx)
    if compiler is None:
        return _fail(f"no C++ compiler ({cxx} did not run)")
    key, library = library_path(cache_dir, compiler, cxx)
    cache_dir = library.parent.parent
    try:
        if not load_cached(library):  # none built yet, or damaged on disk: built (and loaded by cpp_extension)
            cache_dir.mkdir(parents=True, exist_ok=True)
            with one_start_at_a_time(cache_dir, "qkernels", "building the integer kernels", progress):
                if not load_cached(library):  # else another start built it while this one waited
                    remove(library.parent)
                    build(cache_dir, library.parent, progress, cxx)
        mark_used(library.parent)
        register_fakes()
        lacking = unrunnable_paths()
        if lacking:  # one of its instructions would end the process (SIGILL): use torch's kernels instead
            return _fail(f"built for a CPU with {lacking} ($SPECDEC_QKERNELS_ARCH), which this one lacks")
    except Exception as error:  # compiler errors, a missing ninja, an unloadable library: all mean "not here"
        lines = [line for line in str(error).splitlines() if line.strip()]
        first = next((line for line in lines if "error:" in line), lines[0] if lines else type(error).__name__)
        return _fail(f"the kernel build failed ({first[:160]}); SPECDEC_QKERNELS_VERBOSE=1 shows the compiler")
    _state.update(loaded=True, key=key)
    return True


def load_cached(library: Path) -> bool:
    """Loads a build kept in the cache; False where there is none or it is damaged: its bytes differ from the digest
    its build wrote (a truncated library ends the process with SIGBUS inside dlopen, past any handler), or dlopen
    refuses it. A build from before the digests is left to dlopen."""
    digest = library.with_name(library.name + ".sha256")
    try:
        if digest.is_file() and digest.read_bytes().strip() != file_digest(library).encode():  # bytes: never undecodable
            return False
        torch.ops.load_library(str(library))
    except OSError:
        return False
    return True


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def library_path(cache_dir: Path, compiler: str, cxx: str) -> tuple[str, Path]:
    """The build's key and where its library is (or will be) for this source, compiler, torch and CPU."""
    key = build_key(compiler, cxx)
    cache_dir = Path(os.environ.get("SPECDEC_QKERNELS_DIR") or cache_dir)
    return key, cache_dir / f"qkernels-{key}" / f"{NAME}.so"


def will_build(cache_dir: Path) -> bool:
    """Whether `ensure(cache_dir)` would compile the kernels: a first start on this machine (or after an update of
    the sources, compiler or torch), whose models are then prepared again too."""
    if _state["loaded"] or _state["why"] is not None or os.environ.get("SPECDEC_QKERNELS", "").lower() == "off":
        return False
    cxx = compiler_command()
    compiler = compiler_version(cxx)
    try:
        return compiler is not None and not library_path(cache_dir, compiler, cxx)[1].is_file()
    except OSError:  # a folder this user cannot enter: the caller's writability check says so, in one line
        return True


def import_cpp_extension():
    """torch.utils.cpp_extension without its import-time warning: a CUDA build of torch on a machine with no GPU
    but a CUDA toolkit logs "No CUDA runtime is found, using CUDA_HOME=…" into the first start's lines (torch
    2.14.1+cu130 here), which says nothing about a CPU build. SPECDEC_QKERNELS_VERBOSE=1 keeps it."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if os.environ.get("SPECDEC_QKERNELS_VERBOSE") != "1":
        log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def build(cache_dir: Path, folder: Path, progress: bool = True, cxx: str | None = None) -> None:
    cpp_extension = import_cpp_extension()

    from utils.models.cache_folder import work_prefix

    ninja_dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package puts its binary beside itself

        ninja_dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join(ninja_dirs + [path])  # for the build alone: restored after it
    verbose = os.environ.get("SPECDEC_QKERNELS_VERBOSE") == "1"
    if progress:
        print("building the integer kernels for this CPU (one time only)…", file=sys.stderr, flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=work_prefix("qkernels"), dir=cache_dir))
    try:
        sources = [str(SOURCE)] + [str(SOURCE.with_name(name)) for name in OTHER_SOURCES]
        try:
            cpp_extension.load(name=NAME, sources=sources, build_directory=str(work), is_python_module=False,
                               extra_cflags=compile_flags(),
                               extra_ldflags=link_flags(cxx), verbose=verbose)
        except BaseException:  # Ctrl-C, SIGTERM (infer.py's Terminated), a failed compile
            stop_compilers(work)
            raise
        kept = work / "kept"
        kept.mkdir()
        shutil.copy2(work / f"{NAME}.so", kept / f"{NAME}.so")
        (kept / f"{NAME}.so.sha256").write_text(file_digest(kept / f"{NAME}.so") + "\n")  # for `load_cached`
        try:
            os.replace(kept, folder)
        except OSError:
            if not (folder / f"{NAME}.so").is_file():  # another start finished first: use its build
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.environ["PATH"] = path


def stop_compilers(work: Path) -> None:
    """A build cut short ends ninja (`subprocess.run` kills it on the way out), not the compilers it started: they
    went on for their whole compile (three `cc1plus`, ~45% of a core each) after the program had left. Each works
    in `work`, a folder of this build alone, which is how they are found (Linux's /proc; elsewhere, nothing)."""
    ours = str(work)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(entry / "cwd")
            if (cwd == ours or cwd.startswith(ours + os.sep)) and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGTERM)
        except OSError:  # gone meanwhile, or another user's
            continue


def _fail(reason: str) -> bool:
    _state["why"] = reason
    return False


def loaded() -> bool:
    return _state["loaded"]


def why() -> str | None:
    """Why the kernels are not loaded (None when they are, or when `ensure` was not called)."""
    return _state["why"]


def key() -> str | None:
    return _state["key"]


def quantize(x: torch.Tensor, type_name: str, namespace=None) -> torch.Tensor:
    """x [rows, in] float32 -> the activation blocks a weight of `type_name` is multiplied with, by the build of
    `namespace` (default: `ops()`)."""
    build = namespace or ops()
    return build.quantize_q8k(x) if type_name in K_TYPES else build.quantize_q8(x)


def unrunnable_paths() -> str:
    """The compiled paths this CPU cannot run, named ("" for none): only a build for another CPU
    (`$SPECDEC_QKERNELS_ARCH`) can hold one. The build says which flags each path executes (`path_flags`: the
    VNNI path is AVX-VNNI's or AVX-512's encoding, as compiled). Where /proc/cpuinfo has no flags (Arm), none."""
    if not arch_override() or platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    flags = cpu_flags()
    return ", ".join(PATHS[p] for p, need in zip(torch.ops.specdec.paths(), torch.ops.specdec.path_flags())
                     if not set(need.split()) <= flags)


def cpu_flags() -> set[str]:
    from utils.models.kernel_choice import cpu_flags as flags

    return flags()


def paths() -> list[int]:
    return list(torch.ops.specdec.paths()) if loaded() else []


def describe() -> str:
    if loaded():
        return "integer kernels " + "/".join(PATHS[p] for p in paths())
    # not tried: no model runs GGUF blocks natively (a float32 or Hugging Face checkpoint)
    return f"no integer kernels: {why()}" if why() is not None else "integer kernels unused (no native GGUF weights)"


def register_fakes() -> None:
    """Shapes for torch.compile and meta tensors."""
    @torch.library.register_fake("specdec::quantize_q8")
    def _(x, path=-1):
        return x.new_empty((x.shape[0], x.shape[1] // 32 * ACTIVATION_BLOCK_BYTES), dtype=torch.uint8)

    @torch.library.register_fake("specdec::quantize_q8k")
    def _(x, path=-1):
        return x.new_empty((x.shape[0], x.shape[1] // 256 * K_ACTIVATION_BLOCK_BYTES), dtype=torch.uint8)

    @torch.library.register_fake("specdec::gguf_mm")
    def _(xq, blocks, type, in_features, path=-1):
        return xq.new_empty((xq.shape[0], blocks.shape[0]), dtype=torch.float32)

    names = {v: k for k, v in TYPES.items()}

    @torch.library.register_fake("specdec::interleave")
    def _(w, type):
        file, grouped = X8_ROW_BYTES[names[type]]
        return w.new_empty((w.shape[0], w.shape[1] // file * grouped))

    @torch.library.register_fake("specdec::deinterleave")
    def _(w, type):
        file, grouped = X8_ROW_BYTES[names[type]]
        return w.new_empty((w.shape[0], w.shape[1] // grouped * file))

    @torch.library.register_fake("specdec::embedding_rows")
    def _(table, type, cols, ids):
        return table.new_empty((ids.numel(), cols), dtype=torch.float32)

    @torch.library.register_fake("specdec::requantize_q4_1")
    def _(blocks, type, cols):
        return blocks.new_empty((blocks.shape[0], cols // 32 * 20))

    @torch.library.register_fake("specdec::attn_in")
    def _(hidden, norm, eps, weights, types, biases, cos, sin, heads, kv_heads):
        rows, dim = hidden.numel() // hidden.shape[-1], cos.shape[-1]
        return tuple(hidden.new_empty((1, n, rows, dim)) for n in (heads, kv_heads, kv_heads))

    def attention_shape(q, k, v, scale):
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))

    for name in ("specdec::attention", "specdec::attention_portable"):  # the same rule, two paths
        torch.library.register_fake(name)(attention_shape)

    @torch.library.register_fake("specdec::attn_out_mlp")
    def _(hidden, attn, weights, types, biases, norm, eps):
        return torch.empty_like(hidden)

    @torch.library.register_fake("specdec::decoder_stack")
    def _(hidden, cos, sin, weights, types, biases, norms, eps, heads, kv_heads, keys, values, start, keep, scale):
        rows = keep if 0 < keep < hidden.shape[1] else hidden.shape[1]
        return hidden.new_empty((1, rows, hidden.shape[2]))
