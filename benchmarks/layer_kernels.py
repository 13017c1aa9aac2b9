"""`python -m benchmarks.layer_kernels`: each linear-layer shape of the embedded pair, timed with every kernel
that can run it, at the pass widths speculative decoding uses (1 row: decoding and drafting; 4: a gamma-3
verification; 9: gamma 8; 40: a prefill or cache-off pass), weights streamed from memory as in a real pass.

The kernel choice at a model's first load does the same at 1 and 9 rows (utils/models/kernel_choice.py); this
prints the whole table, with the effective bandwidth at one row (bytes of the file's blocks read per second).
`--paths` times our integer kernel instead on each code path this CPU compiled (AVX2, AVX-VNNI, AVX512-VNNI…),
the paths taking turns call by call, so that a quiet spell or a busy one falls on all of them alike. `--pass` times
the products of one whole pass instead: every quantised weight of a model's file once, in the file's order (the
weights stream from memory as in a real pass), per path, paths taking turns pass by pass.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from utils.models import qkernels
from utils.models.gguf_blocks import BLOCK_LAYOUT, RawBlocks, q4_0_as_q4_1, synthetic_blocks
from utils.models.gguf_native import file_tensors
from utils.models.kernel_choice import (COLD_BYTES, MAX_COPIES, REPEATS, Shape, describe_cpu, measure,
                                        samples_in_turns)
from utils.models.model_loader import DEFAULT_TARGET, cache_root, gguf_file
from benchmarks.cli import count_list, guarded, tool_parser

# (type, out, in, layers using it) of the two embedded files' linear layers (the gguf package lists them)
SHAPES = {
    "1.5B target": [("Q4_K", 1536, 1536, 56), ("Q4_K", 256, 1536, 42), ("Q6_K", 256, 1536, 14),
                    ("Q4_K", 8960, 1536, 56), ("Q4_K", 1536, 8960, 14), ("Q6_K", 1536, 8960, 14),
                    ("Q6_K", 151936, 1536, 1)],
    "0.5B drafter": [("Q5_0", 896, 896, 48), ("Q5_0", 128, 896, 36), ("Q8_0", 128, 896, 12),
                     ("Q5_0", 4864, 896, 48), ("Q4_K", 896, 4864, 12), ("Q6_K", 896, 4864, 12),
                     ("Q8_0", 151936, 896, 1)],
}


def interleaved(paths: list, call, repeats: int) -> dict:
    """{path: seconds of each timed `call(path)`}, the paths (or other contenders) taking turns as the kernel
    choice times its candidates (`samples_in_turns`: WARMUP untimed rounds, every other turn reversed)."""
    return samples_in_turns({p: (lambda p=p: call(p)) for p in paths}, repeats)


def contenders() -> list[int]:
    return [p for p in qkernels.paths() if p != 0]  # the portable path is the reference, not a contender


def time_paths(type_name: str, out_features: int, in_features: int, widths: tuple[int, ...],
               x8: bool = False) -> dict:
    """{path: {rows: seconds}} of `gguf_mm` on synthetic blocks, weights cold (copies cycled), the median; with
    `x8`, the blocks interleaved (gguf8: `type_name` must be one of `qkernels.X8`)."""
    copies = max(1, min(MAX_COPIES, COLD_BYTES // (out_features * in_features // 2)))
    blocks = [synthetic_blocks(type_name, out_features, in_features).data for _ in range(copies)]
    kind = qkernels.TYPES[type_name]
    if x8:
        blocks, kind = [torch.ops.specdec.interleave(b, kind) for b in blocks], qkernels.X8[type_name]
    times = {p: {} for p in contenders()}
    for rows in widths:
        xq = qkernels.quantize(torch.randn(rows, in_features), type_name)
        turns = itertools.cycle(blocks)
        samples = interleaved(contenders(), lambda p: torch.ops.specdec.gguf_mm(
            xq, next(turns), kind, in_features, p), REPEATS)
        for p, values in samples.items():
            times[p][rows] = sorted(values)[len(values) // 2]
    return times


def interleaved_as_run(name: str, n: int, blocks: torch.Tensor, kind: int) -> tuple:
    """A weight of the pass as native mode runs it under gguf8: the types of `qkernels.X8` (whole groups of 8 rows)
    interleaved, Q4_0 as Q4_1 first (`q4_0_as_q4_1`); others as in the file. `name` stays the file's type (the
    activations' key)."""
    if name == "Q4_0" and blocks.shape[0] % 8 == 0:
        converted = q4_0_as_q4_1(RawBlocks(name, blocks, n))
        if converted.type_name == "Q4_1":
            return name, n, torch.ops.specdec.interleave(converted.data, qkernels.TYPES["Q4_1"]), qkernels.X8["Q4_1"]
    if name in qkernels.X8 and blocks.shape[0] % 8 == 0:
        return name, n, torch.ops.specdec.interleave(blocks, kind), qkernels.X8[name]
    return name, n, blocks, kind


def time_pass(gguf_path, widths: tuple[int, ...], repeats: int = 6, x8: bool = False) -> dict:
    """{label: {rows: seconds}}: the least time over `repeats` of gguf_mm over every quantised 2-D weight of the
    file but the token embeddings (a lookup), random activations; one label per code path, or with `x8` the best
    path with the weights as in the file, then each path with those of `qkernels.X8`'s types (of whole groups of 8
    rows) interleaved (gguf8)."""
    mats = [(t.tensor_type.name, int(t.shape[0]), torch.from_numpy(np.array(t.data)),  # type, in, [out, bytes],
             qkernels.TYPES[t.tensor_type.name])  # type id
            for t in file_tensors(gguf_path)
            if t.name != "token_embd.weight" and t.tensor_type.name in qkernels.TYPES and len(t.shape) == 2]
    if x8:
        grouped = [interleaved_as_run(name, n, b, kind) for name, n, b, kind in mats]
        best = qkernels.paths()[-1]
        kinds = "/".join(qkernels.X8)
        runs = {f"{qkernels.PATHS[best]}, {kinds}/Q4_0 as in the file": (best, mats),
                **{f"{qkernels.PATHS[p]}, {kinds} interleaved, Q4_0 as Q4_1 (gguf8)": (p, grouped)
                   for p in contenders()}}
    else:
        runs = {qkernels.PATHS[p]: (p, mats) for p in contenders()}
    times = {label: {} for label in runs}
    for rows in widths:
        xq = {(name, n): qkernels.quantize(torch.randn(rows, n), name) for name, n, _, _ in mats}

        def one_pass(label: str) -> None:
            path, weights = runs[label]
            for name, n, blocks, kind in weights:
                torch.ops.specdec.gguf_mm(xq[name, n], blocks, kind, n, path)

        for label, values in interleaved(list(runs), one_pass, repeats).items():
            times[label][rows] = min(values)
    return times


def print_pass(model: str, widths: tuple[int, ...], x8: bool = False) -> None:
    path = gguf_file(model)
    print(f"products of one pass of {model} (every quantised weight once), least of 5, ms\n")
    print("| kernel | " + " | ".join(f"{w} rows" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for label, times in time_pass(path, widths, x8=x8).items():
        print(f"| {label} | " + " | ".join(f"{times[w] * 1e3:.1f}" for w in widths) + " |", flush=True)


def main(argv=None) -> None:
    p = tool_parser("benchmarks.layer_kernels", __doc__)
    p.add_argument("--widths", type=count_list(1), default="1,4,9,40", help="activation rows, comma-separated")
    p.add_argument("--model", choices=sorted(SHAPES), default=None, help="one model's shapes (default: both)")
    p.add_argument("--paths", action="store_true", help="our integer kernel on each compiled code path")
    p.add_argument("--pass", dest="whole_pass", metavar="MODEL", default=None,
                   help=f"the products of one whole pass of MODEL (e.g. {DEFAULT_TARGET}) on each code path")
    p.add_argument("--x8", action="store_true",
                   help="with --pass: the weights as in the file (best path) against those that can be interleaved so (gguf8, each "
                        "path); with --paths: each shape interleaved, the drafter's re-quantised to Q4_1 as it runs")
    args = p.parse_args(argv)
    if args.x8 and not (args.paths or args.whole_pass):
        p.error("--x8 goes with --paths or --pass")
    if args.whole_pass and (args.model or args.paths):  # a pass times every path of its one model already
        p.error(f"--{'model' if args.model else 'paths'} goes without --pass (--pass MODEL names the model and "
                "times every path)")
    widths = tuple(args.widths)
    if not qkernels.ensure(cache_root()):
        print(f"note: {qkernels.why()}")
        if args.paths or args.whole_pass:
            return
    print(f"{describe_cpu()}; {qkernels.describe()}\n")
    if args.whole_pass:
        return print_pass(args.whole_pass, widths, args.x8)
    print("| model | type | out x in | layers | kernel | " + " | ".join(f"{w} rows ms" for w in widths)
          + f" | GB/s at {widths[0]} row{'s' * (widths[0] > 1)} |")
    print("|---|---|---|---|---|" + "---|" * len(widths) + "---|")
    for model, shapes in SHAPES.items():
        if args.model and model != args.model:
            continue
        for type_name, out_features, in_features, layers in shapes:
            if args.paths and args.x8:  # the layers the product interleaves: the target's Q4_K and Q6_K (its
                if model == "0.5B drafter":  # head too), the drafter's re-quantised to Q4_1 (its head is not)
                    if out_features == 151936:
                        continue
                    type_name = type_name if type_name == "Q4_K" else "Q4_1"
                elif type_name not in qkernels.X8:
                    continue
            values, nbytes, _ = BLOCK_LAYOUT[type_name]
            file_bytes = out_features * in_features // values * nbytes
            if args.paths:
                timed = {qkernels.PATHS[p]: t for p, t in
                         time_paths(type_name, out_features, in_features, widths, args.x8).items()}
            else:
                timed = measure(Shape(type_name, out_features, in_features), widths)
            for kernel, times in timed.items():
                cells = " | ".join(f"{times[w] * 1e3:.3f}" for w in widths)
                print(f"| {model} | {type_name} | {out_features}x{in_features} | {layers} | {kernel} | {cells} | "
                      f"{file_bytes / times[widths[0]] / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    guarded(main)
