"""`python -m benchmarks.issue_rate`: how many of our AVX2 tiles' two main instructions one core of this machine
issues a cycle, alone and mixed: the ceiling that a wide (compute-bound) pass of the Q4_K x8 tile can approach.

The tile's inner step is a `vpmaddubsw` (32 products of weight nibbles and activation bytes) whose int16 result a
`vpaddw` adds into the sub-block's sum (interleaved.h). Probes, each in eight independent register chains so that
no latency limits them, compiled from C by the system compiler:
- maddubs: `vpmaddubsw ymm` alone;
- paddw: `vpaddw ymm` alone;
- pair: a `vpmaddubsw` and a `vpaddw` into an accumulator, as the tile has them;
- fma: `vfmadd231ps ymm` alone (float work a tile could run beside its integer products);
- mixed: four `vpmaddubsw` and four `vfmadd231ps` a step, all independent: if the two issued on separate
  resources, the mix would issue about twice either alone.
The clock is a chain of dependent scalar adds (one a cycle), timed right before and after each probe; the probes
take turns and the best of `--repeats` is kept (a VM's vCPU loses time to other guests in bursts: the best turn is
the least disturbed one). x86-64 with AVX2 only; elsewhere it says so in one line.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from benchmarks.cli import at_least, guarded, tool_parser

PROBE_TIMEOUT_S = 600  # the probes' whole run; the default --iterations take seconds
PROBES = ("maddubs", "paddw", "pair", "fma", "mixed")

# Eight chains a loop iteration; `sink` keeps the accumulators alive; no array (GCC kept an array of
# accumulators in memory and stored all eight every iteration: a store-bound loop, not the probe).
SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static volatile int sink;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define EIGHT(op) op op op op op op op op
static double clock_rate(long n) {  /* dependent adds a second: cycles a second */
  unsigned long a = 1; double t = now();
  for (long i = 0; i < n / 8; i++) __asm__ volatile(EIGHT("add $1, %0\n") : "+r"(a));
  return n / (now() - t);
}
#define CHAINS(ins) ins " %8, %9, %0\n" ins " %8, %9, %1\n" ins " %8, %9, %2\n" ins " %8, %9, %3\n" \
                    ins " %8, %9, %4\n" ins " %8, %9, %5\n" ins " %8, %9, %6\n" ins " %8, %9, %7\n"
static double alone(long n, int madd) {  /* instructions a second */
  __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(3), r0, r1, r2, r3, r4, r5, r6, r7;
  double t = now();
  if (madd)
    for (long i = 0; i < n / 8; i++)
      __asm__ volatile(CHAINS("vpmaddubsw") : "=x"(r0), "=x"(r1), "=x"(r2), "=x"(r3), "=x"(r4), "=x"(r5), "=x"(r6),
                       "=x"(r7) : "x"(x), "x"(y));
  else
    for (long i = 0; i < n / 8; i++)
      __asm__ volatile(CHAINS("vpaddw") : "=x"(r0), "=x"(r1), "=x"(r2), "=x"(r3), "=x"(r4), "=x"(r5), "=x"(r6),
                       "=x"(r7) : "x"(x), "x"(y));
  return n / (now() - t);
}
static double fma(long n, int mixed) {  /* instructions a second: 8 FMA chains, or 4 maddubs beside 4 */
  __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(3), m0, m1, m2, m3;
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.5f), f0 = a, f1 = a, f2 = a, f3 = a, f4 = a, f5 = a, f6 = a,
         f7 = a;
  double t = now();
  if (mixed)
    for (long i = 0; i < n / 8; i++)
      __asm__ volatile(
          "vpmaddubsw %8, %9, %4\n vfmadd231ps %10, %11, %0\n vpmaddubsw %8, %9, %5\n vfmadd231ps %10, %11, %1\n"
          "vpmaddubsw %8, %9, %6\n vfmadd231ps %10, %11, %2\n vpmaddubsw %8, %9, %7\n vfmadd231ps %10, %11, %3\n"
          : "+x"(f0), "+x"(f1), "+x"(f2), "+x"(f3), "=&x"(m0), "=&x"(m1), "=&x"(m2), "=&x"(m3)
          : "x"(x), "x"(y), "x"(a), "x"(b));
  else
    for (long i = 0; i < n / 8; i++)
      __asm__ volatile(
          "vfmadd231ps %8, %9, %0\n vfmadd231ps %8, %9, %1\n vfmadd231ps %8, %9, %2\n vfmadd231ps %8, %9, %3\n"
          "vfmadd231ps %8, %9, %4\n vfmadd231ps %8, %9, %5\n vfmadd231ps %8, %9, %6\n vfmadd231ps %8, %9, %7\n"
          : "+x"(f0), "+x"(f1), "+x"(f2), "+x"(f3), "+x"(f4), "+x"(f5), "+x"(f6), "+x"(f7) : "x"(a), "x"(b));
  double seconds = now() - t;
  __m256 z = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)),
                           _mm256_add_ps(_mm256_add_ps(f4, f5), _mm256_add_ps(f6, f7)));
  sink = (int)_mm256_cvtss_f32(z);
  return n / seconds;
}
static double pair(long n) {  /* maddubs + paddw pairs a second */
  __m256i x = _mm256_set1_epi8(1), y = _mm256_set1_epi8(3);
  __m256i s0 = x, s1 = x, s2 = x, s3 = x, s4 = x, s5 = x, s6 = x, s7 = x, p0, p1, p2, p3;
  double t = now();
  for (long i = 0; i < n / 8; i++)
    __asm__ volatile(
        "vpmaddubsw %12, %13, %8\n vpmaddubsw %12, %13, %9\n vpmaddubsw %12, %13, %10\n vpmaddubsw %12, %13, %11\n"
        "vpaddw %8, %0, %0\n vpaddw %9, %1, %1\n vpaddw %10, %2, %2\n vpaddw %11, %3, %3\n"
        "vpmaddubsw %12, %13, %8\n vpmaddubsw %12, %13, %9\n vpmaddubsw %12, %13, %10\n vpmaddubsw %12, %13, %11\n"
        "vpaddw %8, %4, %4\n vpaddw %9, %5, %5\n vpaddw %10, %6, %6\n vpaddw %11, %7, %7\n"
        : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3), "+x"(s4), "+x"(s5), "+x"(s6), "+x"(s7), "=&x"(p0), "=&x"(p1),
          "=&x"(p2), "=&x"(p3) : "x"(x), "x"(y));
  double seconds = now() - t;
  __m256i z = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)),
                               _mm256_add_epi16(_mm256_add_epi16(s4, s5), _mm256_add_epi16(s6, s7)));
  sink = _mm256_extract_epi16(z, 0);
  return n / seconds;
}
int main(int argc, char** argv) {
  long n = atol(argv[1]); int repeats = atoi(argv[2]);
  for (int r = 0; r < repeats; r++) {
    double c0 = clock_rate(n), m = alone(n, 1), c1 = clock_rate(n), w = alone(n, 0), c2 = clock_rate(n);
    double p = pair(n), c3 = clock_rate(n), f = fma(n, 0), c4 = clock_rate(n), x = fma(n, 1), c5 = clock_rate(n);
    printf("%d %.4f %.4f %.4f %.4f %.4f %.4f\n", r, (c0 + c1 + c2 + c3 + c4 + c5) / 6e9, m / ((c0 + c1) / 2),
           w / ((c1 + c2) / 2), p / ((c2 + c3) / 2), f / ((c3 + c4) / 2), x / ((c4 + c5) / 2));
  }
  return 0;
}
"""


def supported() -> str | None:
    """None where the probe can run, else why not (one line)."""
    from utils.models.kernel_choice import cpu_facts

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the probe is x86-64 assembly; this machine is {platform.machine()}"
    missing = [flag for flag in ("avx2", "fma") if flag not in cpu_facts()["flags"]]
    if missing:  # the FMA probes are built with -mfma: without FMA they would die on an illegal instruction
        return f"this CPU lists no {' or '.join(f.upper() for f in missing)} in /proc/cpuinfo"
    if shutil.which("cc") is None:
        return "no C compiler (cc)"
    return None


def run_step(what: str, command: list[str], timeout: int) -> str:
    """A step's stdout; its failure a RuntimeError of one line (the compiler's first complaint, the time out)."""
    try:
        return subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} took more than {timeout} s (fewer --iterations or --repeats)") from None
    except subprocess.CalledProcessError as error:
        said = (error.stderr or error.stdout or "").strip().splitlines()
        raise RuntimeError(f"{what} failed (exit status {error.returncode})" + (f": {said[0]}" if said else "")) from None


def eights(text: str) -> int:
    """An argparse type: a multiple of 8 (each probe's loop issues eight instructions a step; the rates divide by
    this count)."""
    value = at_least(8)(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"expected a multiple of 8, got {text!r}")
    return value


def measure(iterations: int, repeats: int) -> list[dict]:
    """One row a turn: the clock (G dependent adds a second) and each probe's instructions (pairs) a cycle."""
    with tempfile.TemporaryDirectory(prefix="specdec-issue-rate-") as folder:
        source, binary = Path(folder) / "probe.c", Path(folder) / "probe"
        source.write_text(SOURCE)
        run_step("compiling the probe with cc", ["cc", "-O2", "-mavx2", "-mfma", "-o", str(binary), str(source)], 120)
        out = run_step("the probe", [str(binary), str(iterations), str(repeats)], PROBE_TIMEOUT_S)
    rows = []
    for line in out.splitlines():
        turn, clock, *rates = line.split()
        rows.append({"turn": int(turn), "clock": float(clock), **dict(zip(PROBES, map(float, rates)))})
    return rows


def main(argv=None) -> None:
    p = tool_parser("benchmarks.issue_rate", __doc__)
    p.add_argument("--repeats", type=at_least(1), default=8, help="turns of all the probes")
    p.add_argument("--iterations", type=eights, default=40_000_000,
                   help="instructions (pairs) a probe issues a turn, a multiple of 8 (default 40000000)")
    args = p.parse_args(argv)
    why = supported()
    if why:
        print(f"issue_rate: {why}")
        return
    from utils.models.kernel_choice import cpu_facts

    rows = measure(args.iterations, args.repeats)
    facts = cpu_facts()
    print(f"{facts['cpu']} ({' '.join(facts['flags'])}), one core")
    print("| turn | clock (G adds/s) | maddubs a cycle | paddw a cycle | maddubs + paddw pairs a cycle | fma a cycle "
          "| maddubs and fma, instructions a cycle |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn']} | {r['clock']:.2f} | " + " | ".join(f"{r[name]:.2f}" for name in PROBES) + " |")
    best = {name: max(r[name] for r in rows) for name in PROBES}
    print("| best | | " + " | ".join(f"{best[name]:.2f}" for name in PROBES) + " |")


if __name__ == "__main__":
    guarded(lambda: main(sys.argv[1:]))
