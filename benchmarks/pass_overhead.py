"""What a pass costs outside the integer products, in one process, in turns: the attention op's AVX2 items
against its plain C++ loops (`attention_portable`, the same bits), and a native model's pass one way against
another (`--switch`, the same bits either way):

- `stacked`: every layer in one op (`decoder_stack`) against the per-layer loop (`lean_forward.STACKED`);
- `embedding`: the looked-up embedding rows decoded by our op (`specdec::embedding_rows`) against the torch decode
  (`native_linear.EMBEDDING_OP`).

    python -m benchmarks.pass_overhead                       # attention shapes of the 1.5B and 0.5B, both models' passes
    python -m benchmarks.pass_overhead --switch embedding    # the same passes, the embedding's two ways
    python -m benchmarks.pass_overhead --skip-models         # attention only (no embedded models needed)

Attention: random q, k, v with the keys as views of a longer buffer (as the cache hands them out), microseconds a
layer, the best of 4 turns after untimed ones, the two paths taking turns. Passes: 200 positions held, then passes of
the given widths cropped back each time, milliseconds; the two ways take `--rounds` turns after untimed ones. Both
take turns as the kernel choice times its candidates (`samples_in_turns`: the order reversed every other turn), each
turn of passes 30 passes; each pass figure is followed by the part of it spent outside the ops the model calls
through `qkernels.ops()` (the layers, the products, the head's; the timing wrapper's two clock reads a call count as
outside), in brackets.
"""

from __future__ import annotations

import time

import torch

from benchmarks.run import machine
from utils.models import qkernels
from utils.models.kernel_choice import WARMUP, samples_in_turns
from utils.models.model_loader import cache_root
from benchmarks.cli import at_least, choice_list, count_list, guarded, tool_parser

ATTENTION_SHAPES = {  # name: (heads, kv heads, dim, rows, keys); target 1.5B, drafter 0.5B, rows x keys
    "target-1x200": (12, 2, 128, 1, 200),
    "target-1x1500": (12, 2, 128, 1, 1500),
    "target-4x200": (12, 2, 128, 4, 200),  # a verification
    "target-60x60": (12, 2, 128, 60, 60),  # a cache-off pass
    "drafter-1x200": (14, 2, 64, 1, 200),
    "tiny-2x20": (4, 2, 64, 2, 20),
}


def batch_of(fn, calls: int):
    """A call running `fn` `calls` times: one turn of `samples_in_turns` (a call of the op alone is too short to
    time)."""
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def attention_table(names: list[str]) -> None:
    print("attention op, us a layer: AVX2 items | plain loops (same bits)")
    for name in names:
        heads, kv_heads, dim, rows, keys = ATTENTION_SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, rows, dim, generator=gen)
        k, v = (torch.randn(1, kv_heads, keys + 64, dim, generator=gen)[:, :, :keys] for _ in range(2))
        scale = dim**-0.5
        fast = lambda: torch.ops.specdec.attention(q, k, v, scale)
        plain = lambda: torch.ops.specdec.attention_portable(q, k, v, scale)
        calls = max(20, 200_000 // (heads * rows * keys))
        same = torch.equal(fast(), plain())
        # an even count: each path goes first in half the timed turns
        turns = samples_in_turns({"fast": batch_of(fast, calls), "plain": batch_of(plain, calls)}, 4)
        best = {way: min(seconds) / calls * 1e6 for way, seconds in turns.items()}
        print(f"  {name}: {best['fast']:.1f} | {best['plain']:.1f}  same bits: {same}")


# --switch: (module, flag) whose False is the old way and True the new, and what each way is called
SWITCHES = {"stacked": ("utils.models.lean_forward", "STACKED", "per-layer loop", "one op"),
            "embedding": ("utils.models.native_linear", "EMBEDDING_OP", "torch decode", "embedding op")}


class TimedOps:
    """Our op namespace with the seconds spent inside its calls added up (`inside`)."""

    def __init__(self, namespace):
        self.namespace, self.inside = namespace, 0.0

    def __getattr__(self, name):  # once a name: the wrapper is kept as an attribute
        op = getattr(self.namespace, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - start

        setattr(self, name, timed)
        return timed


def pass_table(widths: list[int], rounds: int, switch: str = "stacked") -> None:
    import importlib

    from utils.caching import new_cache
    from utils.models.draft_vocab import use_draft_vocab
    from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model

    module_name, flag, old_name, new_name = SWITCHES[switch]
    module = importlib.import_module(module_name)

    drafter, tokenizer = load_model(DEFAULT_DRAFTER, int8=True, int4_drafter=True, progress=False)
    use_draft_vocab(drafter, tokenizer, 32768)  # the drafter as the chat drafts with it
    models = {"0.5B drafter": drafter, "1.5B target": load_model(DEFAULT_TARGET, progress=False)[0]}
    print(f"passes, ms (outside our ops), 200 positions held: {old_name} | {new_name} (each round's figure)")
    timed = TimedOps(torch.ops.specdec)
    for name, model in models.items():
        cache = new_cache(model)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 1000, (1, 200)), past_key_values=cache, use_cache=True, logits_to_keep=1)
            for width in widths:
                ids = torch.randint(0, 1000, (1, width))

                def passes(n: int = 30) -> tuple[float, float]:
                    qkernels.use_ops(timed)
                    timed.inside = 0.0
                    try:
                        start = time.perf_counter()
                        for _ in range(n):
                            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=width)
                            cache.crop(-width)
                        total = time.perf_counter() - start
                    finally:
                        qkernels.use_ops(None)
                    return total / n * 1e3, (total - timed.inside) / n * 1e3

                figures, before = {False: [], True: []}, getattr(module, flag)

                def way(on: bool):
                    def run() -> None:
                        setattr(module, flag, on)
                        figures[on].append(passes())
                    return run

                try:  # the kernel choice's turns; its own clock is not read: `passes` keeps both figures
                    samples_in_turns({False: way(False), True: way(True)}, rounds)
                finally:
                    setattr(module, flag, before)
                figures = {on: rounds_[WARMUP:] for on, rounds_ in figures.items()}  # the untimed turns dropped
                show = lambda xs: " ".join(f"{x:.2f} ({outside:.2f})" for x, outside in xs)
                print(f"  {name}, {width} row(s): {show(figures[False])} | {show(figures[True])}")


def main(argv=None) -> None:
    p = tool_parser("benchmarks.pass_overhead", __doc__)
    p.add_argument("--skip-models", action="store_true", help="attention only")
    p.add_argument("--attention", type=choice_list(ATTENTION_SHAPES), default=list(ATTENTION_SHAPES)[:5],
                   help="comma-separated attention shapes: " + ", ".join(ATTENTION_SHAPES))
    p.add_argument("--widths", type=count_list(1), default="1,4")
    p.add_argument("--rounds", type=at_least(1), default=4)
    p.add_argument("--switch", choices=sorted(SWITCHES), default="stacked", help="what the passes compare")
    args = p.parse_args(argv)
    if not qkernels.ensure(cache_root()):
        raise SystemExit(f"the integer kernels are not built here: {qkernels.why()}")
    print(machine())
    attention_table(args.attention)
    if not args.skip_models:
        pass_table(args.widths, args.rounds, args.switch)


if __name__ == "__main__":
    guarded(main)
