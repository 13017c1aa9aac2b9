"""`python -m benchmarks.kernels`: what one forward pass of the target costs, by number of new tokens.

A speculative round is one target pass over 1 + gamma tokens; it pays only when that pass costs much less than
1 + gamma one-token passes. This measures it for each float32 linear kernel on this machine: torch's default
(MKL), `torch.utils.mkldnn.MkldnnLinear` (oneDNN, layout per call) and `PackedLinear` (oneDNN, weights packed
once; what `--onednn` uses). The cache holds a 200-token context; each pass is rolled back after timing.
"""

from __future__ import annotations

import statistics
import time

import torch

from utils.caching import new_cache, prune_cache
from utils.models.cpu_kernels import PackedLinear, replace_linear
from utils.models.model_loader import DEFAULT_TARGET, load_model
from benchmarks.cli import at_least, guarded, tool_parser

WIDTHS = (1, 2, 3, 5, 9, 13)


@torch.no_grad()
def pass_costs(model: torch.nn.Module, repeats: int) -> dict[int, float]:
    """Median milliseconds of one cached forward over `w` new tokens, for each width."""
    generator = torch.Generator().manual_seed(0)
    cache = new_cache(model)
    model(input_ids=torch.randint(0, 1000, (1, 200), generator=generator), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    times: dict[int, list[float]] = {w: [] for w in WIDTHS}
    for rep in range(repeats + 1):  # the first round warms up
        for w in WIDTHS:
            x = torch.randint(0, 1000, (1, w), generator=generator)
            start = time.perf_counter()
            model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=w)
            elapsed = time.perf_counter() - start
            cache = prune_cache(cache, w)
            if rep:
                times[w].append(elapsed * 1000)
    return {w: statistics.median(v) for w, v in times.items()}


def main(argv=None) -> None:
    p = tool_parser("benchmarks.kernels", __doc__)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--repeats", type=at_least(1), default=5)
    args = p.parse_args(argv)
    from torch.utils import mkldnn

    kernels = {
        "MKL (torch default)": None,
        "oneDNN MkldnnLinear": lambda linear: mkldnn.MkldnnLinear(linear, torch.float32),
        "oneDNN PackedLinear": PackedLinear,
    }
    from utils.models.kernel_choice import describe_cpu

    print(f"Machine: {describe_cpu()}")  # float32 on the CPU, whatever GPU is beside it
    print(f"{args.model}, float32, {torch.get_num_threads()} threads; ms per forward (x one-token pass)\n")
    print("| kernel | " + " | ".join(f"{w} token{'s' if w > 1 else ''}" for w in WIDTHS) + " |")
    print("|---|" + "---|" * len(WIDTHS))
    for label, make in kernels.items():
        model, _ = load_model(args.model, "cpu", "float32")
        if make is not None:
            replace_linear(model, make)
        costs = pass_costs(model, args.repeats)
        cells = [f"{costs[w]:.0f} ({costs[w] / costs[1]:.2f}x)" for w in WIDTHS]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        del model


if __name__ == "__main__":
    guarded(main)
