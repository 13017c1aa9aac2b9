"""`python -m benchmarks.kernels`: what one forward pass of the target costs, by number of new tokens.

A speculative round is one target pass over 1 + gamma tokens; it pays only when that pass costs much less than
1 + gamma one-token passes. This measures it for each float32 linear kernel on this machine: torch's default
(MKL), `torch.utils.mkldnn.MkldnnLinear` (oneDNN, layout per call) and `PackedLinear` (oneDNN, weights packed
once; what `--onednn` uses). The cache holds a 200-token context; each pass is rolled back after timing. The
kernels take turns at each width (`samples_in_turns`), so the model holds every kernel's copy of its weights at
once: 18.8 GB at peak for the 1.5B target (Zen 5).
"""

from __future__ import annotations

import statistics
import time

import torch

from utils.caching import new_cache, prune_cache
from utils.models.cpu_kernels import PackedLinear
from utils.models.kernel_choice import WARMUP, samples_in_turns
from utils.models.model_loader import DEFAULT_TARGET, load_model
from benchmarks.cli import EVEN, at_least, guarded, tool_parser

WIDTHS = (1, 2, 3, 5, 9, 13)
CONTEXT = 200  # positions held in the cache when a pass is timed


@torch.no_grad()
def pass_costs(models: dict[str, torch.nn.Module], repeats: int,
               ready=lambda label: None) -> dict[str, dict[int, float]]:
    """{label: {w: median milliseconds of one cached forward over w new tokens}}, the models taking turns at each
    width, on the same context with the same tokens. `ready(label)` runs before each of a model's passes, untimed
    (`kernels` swaps that kernel's layers in)."""
    generator = torch.Generator().manual_seed(0)
    # ordinary tokens of a real vocabulary (its first thousand), any token of a small one
    high = min([1000] + [model.config.vocab_size for model in models.values()])
    context = torch.randint(0, high, (1, CONTEXT), generator=generator)  # the same for every model
    caches = {}
    for label, model in models.items():
        ready(label)
        caches[label] = new_cache(model)
        model(input_ids=context, past_key_values=caches[label], use_cache=True, logits_to_keep=1)
    ms: dict[str, dict[int, list[float]]] = {label: {w: [] for w in WIDTHS} for label in models}
    for w in WIDTHS:
        x = torch.randint(0, high, (1, w), generator=generator)

        def one_pass(label: str):
            def run() -> None:  # times itself: the swap and the rollback stay outside the figure
                ready(label)
                start = time.perf_counter()
                models[label](input_ids=x, past_key_values=caches[label], use_cache=True, logits_to_keep=w)
                ms[label][w].append((time.perf_counter() - start) * 1000)
                caches[label] = prune_cache(caches[label], w)
            return run

        samples_in_turns({label: one_pass(label) for label in models}, repeats)
    return {label: {w: statistics.median(v[WARMUP:]) for w, v in by_width.items()} for label, by_width in ms.items()}


def kernel_layers(model: torch.nn.Module, makes: dict) -> dict[str, list[tuple]]:
    """{label: [(parent, name, layer)] for every `nn.Linear` of `model`}, the layer as `makes[label]` builds it from
    the original (None: the original itself); `swap_in` puts one label's layers in place."""
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    return {label: [(parent, name, child if make is None else make(child)) for parent, name, child in slots]
            for label, make in makes.items()}


def swap_in(layers: list[tuple]) -> None:
    for parent, name, layer in layers:
        setattr(parent, name, layer)


def main(argv=None) -> None:
    p = tool_parser("benchmarks.kernels", __doc__)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--repeats", type=at_least(1), default=6, help=EVEN)
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
    model, _ = load_model(args.model, "cpu", "float32")
    layers = kernel_layers(model, kernels)
    costs = pass_costs(dict.fromkeys(kernels, model), args.repeats, lambda label: swap_in(layers[label]))
    for label, by_width in costs.items():
        cells = [f"{by_width[w]:.0f} ({by_width[w] / by_width[1]:.2f}x)" for w in WIDTHS]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    guarded(main)
