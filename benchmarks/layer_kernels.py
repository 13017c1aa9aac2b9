"""`python -m benchmarks.layer_kernels`: each linear-layer shape of the embedded pair, timed with every kernel
that can run it, at the pass widths speculative decoding uses (1 row: decoding and drafting; 4: a gamma-3
verification; 9: gamma 8; 40: a prefill or cache-off pass), weights streamed from memory as in a real pass.

The kernel choice at a model's first load does the same at 1 and 9 rows (utils/models/kernel_choice.py); this
prints the whole table, with the effective bandwidth at one row (bytes of the file's blocks read per second).
"""

from __future__ import annotations

import argparse

import torch

from utils.models import qkernels
from utils.models.gguf_blocks import BLOCK_LAYOUT
from utils.models.kernel_choice import Shape, describe_cpu, measure
from utils.models.model_loader import cache_root

# (type, out, in, layers using it) of the two embedded files' linear layers (the gguf package lists them)
SHAPES = {
    "1.5B target": [("Q4_K", 1536, 1536, 56), ("Q4_K", 256, 1536, 42), ("Q6_K", 256, 1536, 14),
                    ("Q4_K", 8960, 1536, 56), ("Q4_K", 1536, 8960, 14), ("Q6_K", 1536, 8960, 14),
                    ("Q6_K", 151936, 1536, 1)],
    "0.5B drafter": [("Q5_0", 896, 896, 48), ("Q5_0", 128, 896, 36), ("Q8_0", 128, 896, 12),
                     ("Q5_0", 4864, 896, 48), ("Q4_K", 896, 4864, 12), ("Q6_K", 896, 4864, 12),
                     ("Q8_0", 151936, 896, 1)],
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_kernels", description=__doc__)
    p.add_argument("--widths", default="1,4,9,40")
    p.add_argument("--model", choices=sorted(SHAPES), default=None, help="one model's shapes (default: both)")
    args = p.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))
    if not qkernels.ensure(cache_root()):
        print(f"note: {qkernels.why()}")
    print(f"{describe_cpu()}; {qkernels.describe()}\n")
    print("| model | type | out x in | layers | kernel | " + " | ".join(f"{w} rows ms" for w in widths)
          + " | GB/s at 1 row |")
    print("|---|---|---|---|---|" + "---|" * len(widths) + "---|")
    for model, shapes in SHAPES.items():
        if args.model and model != args.model:
            continue
        for type_name, out_features, in_features, layers in shapes:
            values, nbytes, _ = BLOCK_LAYOUT[type_name]
            file_bytes = out_features * in_features // values * nbytes
            for kernel, times in measure(Shape(type_name, out_features, in_features), widths).items():
                cells = " | ".join(f"{times[w] * 1e3:.3f}" for w in widths)
                print(f"| {model} | {type_name} | {out_features}x{in_features} | {layers} | {kernel} | {cells} | "
                      f"{file_bytes / times[widths[0]] / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
