"""`python -m benchmarks.kernel_ab --base REV`: this tree's integer kernels against a git revision's, in one process.

The revision's kernel sources are built under the op namespace `specdec_base` (in a temporary folder, with the
flags of our own build); products and the embedded models' passes then run on the two builds in turns
(`qkernels.use_ops` switches a loaded model), so that a host whose speed drifts weighs on both alike. On the
2-vCPU VM of benchmarks/RESULTS.md, processes timed one after the other disagreed by up to 20% from one minute to
the next; this is how the fourteenth pass of issue 21 measured its tiles. Both builds must give the same logits
(the weights are prepared once, in this tree's layout): a revision whose layouts differ is refused in one line.
`--base HEAD` on a clean tree compares two builds of the same sources (an A/A run): the spread of its turns'
ratios is this host's noise, the floor under which a difference means nothing.

Prints, per product (synthetic weights, hot; best of `--repeats` turns) and per pass (1.5B target over 200 held
positions, cache-off passes of 40 rows or more; the 0.5B drafter as the chat loads it; medians), milliseconds for
the base and for this tree, and their ratio.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.layer_kernels import interleaved
from benchmarks.cli import at_least, count_list, guarded, tool_parser

BASE_NAMESPACE = "specdec_base"
KERNELS = Path(__file__).resolve().parent.parent / "utils" / "models" / "qkernels"
# (file type, out, in), interleaved where both builds have the layout: the 1.5B's gate/up, its Q6_K down
# projections, the drafter's gate/up
PRODUCTS = (("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q4_1", 4864, 896))
CACHE_OFF_FROM = 40  # passes this wide or wider run without a cache, as the cache-off chat's do


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; bad counts are refused in one line, before any building or loading."""
    parser = tool_parser("benchmarks.kernel_ab", __doc__)
    parser.add_argument("--base", required=True, help="the git revision to compare with (a commit, tag or branch)")
    parser.add_argument("--rows", type=count_list(1), default="1,4,60", help="activation rows of the products (comma-separated)")
    parser.add_argument("--widths", type=count_list(1), default="1,4,9,60", help="new tokens of the target's passes")
    parser.add_argument("--drafter-widths", type=count_list(1), default="1,4,60", help="new tokens of the drafter's passes")
    parser.add_argument("--repeats", type=at_least(1), default=6, help="timed turns of each product and pass")
    parser.add_argument("--base-flags", default=None,
                        help="the base build's compiler flags instead of this tree's (A/B of flags: --base HEAD)")
    args = parser.parse_args(argv)
    if args.base.startswith("-"):  # git would read it as an option of its own and print its usage
        parser.error(f"--base: {args.base!r} is not a git revision")
    try:
        args.base_flags = shlex.split(args.base_flags) if args.base_flags else None
    except ValueError as error:  # an unclosed quote
        parser.error(f"--base-flags: {error}")
    return args


def base_sources(revision: str, folder: Path) -> list[Path]:
    """The revision's kernel sources written into `folder`, its ops renamed to `BASE_NAMESPACE`; the .cpp files."""
    root = KERNELS.parent.parent.parent
    relative = KERNELS.relative_to(root).as_posix()
    listing = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{revision}:{relative}"],
                             capture_output=True, text=True)
    if listing.returncode != 0:
        raise SystemExit(f"kernel_ab: no kernel sources at revision {revision!r} ({listing.stderr.strip()[:120]})")
    names = [n for n in listing.stdout.split() if n.endswith((".h", ".cpp"))]
    for name in names:
        text = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{relative}/{name}"],
                              capture_output=True, text=True, check=True).stdout
        if name == "qkernels.cpp":
            renamed = text.replace("TORCH_LIBRARY(specdec,", f"TORCH_LIBRARY({BASE_NAMESPACE},")
            renamed = renamed.replace("TORCH_LIBRARY_IMPL(specdec,", f"TORCH_LIBRARY_IMPL({BASE_NAMESPACE},")
            if renamed.count(BASE_NAMESPACE) < 2:
                raise SystemExit(f"kernel_ab: the ops of {revision!r} are not registered as `specdec`")
            text = renamed
        (folder / name).write_text(text)
    return sorted(folder / n for n in names if n.endswith(".cpp"))


def build_base(revision: str, folder: Path, flags: list[str] | None = None):
    """The revision's kernels built and loaded: torch.ops.specdec_base."""
    from utils.models import qkernels

    cpp_extension = qkernels.import_cpp_extension()

    sources = base_sources(revision, folder)
    print(f"building the kernels of {revision} (about a minute)…", file=sys.stderr, flush=True)
    build = folder / "build"
    build.mkdir()
    cpp_extension.load(name=BASE_NAMESPACE, sources=[str(s) for s in sources], build_directory=str(build),
                       is_python_module=False, extra_cflags=flags or qkernels.compile_flags(),
                       extra_ldflags=qkernels.link_flags())
    return getattr(torch.ops, BASE_NAMESPACE)


def in_turns(calls: dict, repeats: int, reduce) -> tuple[dict, list[float]]:
    """Seconds per call of each of `calls` ({name: (call, times)}), the builds taking turns (`interleaved`: its
    untimed rounds first, the order reversed every other turn), `reduce` (min or median) over `repeats` timed
    turns of `times` calls each; and each turn's ratio, this tree's time over the base's."""
    samples = interleaved(list(calls), lambda name: [calls[name][0]() for _ in range(calls[name][1])], repeats)
    ratios = [ours / base for base, ours in zip(samples["base"], samples["this tree"])]
    return {name: reduce(seconds) / calls[name][1] for name, seconds in samples.items()}, ratios


def report(label: str, timed: tuple[dict, list[float]]) -> None:
    """One line: both builds' times, their ratio, and the range of the turns' ratios (how far one turn can be
    trusted on this host: `--base HEAD` on a clean tree is an A/A run, whose ratios are all noise)."""
    seconds, ratios = timed
    base, ours = seconds["base"], seconds["this tree"]
    print(f"{label}: base {base * 1e3:.3f} ms, this tree {ours * 1e3:.3f} ms ({ours / base:.3f}x; turns "
          f"{min(ratios):.3f}-{max(ratios):.3f}x)", flush=True)


@torch.no_grad()
def time_products(spaces: dict, rows: list[int], repeats: int) -> None:
    from utils.models import qkernels
    from utils.models.gguf_blocks import synthetic_blocks

    for type_name, out, n in PRODUCTS:
        blocks = synthetic_blocks(type_name, out, n, generator=torch.Generator().manual_seed(0)).data
        type_id = qkernels.TYPES[type_name]
        if type_name in qkernels.X8:
            try:  # both builds must know the layout: a base from before Q6_K_X8 runs Q6_K in the file's
                for ops in spaces.values():
                    grouped = ops.interleave(blocks, type_id)
                blocks, type_id = grouped, qkernels.X8[type_name]
            except RuntimeError:
                pass
        for m in rows:
            x = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
            xq = {name: qkernels.quantize(x, type_name, ops) for name, ops in spaces.items()}
            results = {name: ops.gguf_mm(xq[name], blocks, type_id, n) for name, ops in spaces.items()}
            if not torch.equal(*results.values()):
                raise SystemExit(f"kernel_ab: the builds disagree on a {type_name} product of {m} rows")
            times = max(3, int(2e8 / (m * out * n)))
            calls = {name: (lambda ops=ops, name=name: ops.gguf_mm(xq[name], blocks, type_id, n), times)
                     for name, ops in spaces.items()}
            label = f"{type_name}{' interleaved' if type_id in qkernels.X8.values() else ''} {out} x {n}, {m} rows"
            report(label, in_turns(calls, repeats, min))


@torch.no_grad()
def time_passes(label: str, model, spaces: dict, widths: list[int], repeats: int) -> None:
    from utils.caching import new_cache
    from utils.models import qkernels

    generator = torch.Generator().manual_seed(0)
    cache = new_cache(model)
    model(input_ids=torch.randint(0, 1000, (1, 200), generator=generator), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    check = torch.randint(0, 1000, (1, 60), generator=generator)
    logits = {}
    for name, ops in spaces.items():
        qkernels.use_ops(ops)
        try:
            logits[name] = model(input_ids=check, use_cache=False, logits_to_keep=1).logits
        except RuntimeError as error:  # a base from before one of the model's layouts (Q6_K_X8: 114)
            qkernels.use_ops(None)
            print(f"{label} passes: the {name} build cannot run them ({str(error).splitlines()[0]}): not timed")
            return
    qkernels.use_ops(None)
    if not torch.equal(*logits.values()):
        raise SystemExit("kernel_ab: the builds give different logits (another weight layout at the base?)")

    def one_pass(ops, ids):
        qkernels.use_ops(ops)
        if ids.shape[1] >= CACHE_OFF_FROM:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        else:
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=ids.shape[1])
            cache.crop(-ids.shape[1])

    for width in widths:
        ids = torch.randint(0, 1000, (1, width), generator=generator)
        times = 2 if width >= CACHE_OFF_FROM else 8
        calls = {name: (lambda ops=ops: one_pass(ops, ids), times) for name, ops in spaces.items()}
        off = ", cache off" if width >= CACHE_OFF_FROM else ""
        report(f"{label} pass, {width} rows{off}", in_turns(calls, repeats, statistics.median))
    qkernels.use_ops(None)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from utils.models import qkernels
    from utils.models.cache_folder import cache_root
    from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, use_draft_vocab
    from utils.models.kernel_choice import describe_cpu
    from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model

    if not qkernels.ensure(cache_root()):
        raise SystemExit(f"kernel_ab: {qkernels.why()}")
    with tempfile.TemporaryDirectory(prefix="specdec-kernel-ab-") as folder:
        spaces = {"base": build_base(args.base, Path(folder), args.base_flags), "this tree": torch.ops.specdec}
        print(f"{describe_cpu()}; base {args.base}", flush=True)
        time_products(spaces, args.rows, args.repeats)
        target, _ = load_model(DEFAULT_TARGET, progress=False)
        time_passes("1.5B target", target, spaces, args.widths, args.repeats)
        del target
        drafter, tokenizer = load_model(DEFAULT_DRAFTER, int4_drafter=True, progress=False)
        use_draft_vocab(drafter, tokenizer, DEFAULT_DRAFT_VOCAB)
        time_passes("0.5B drafter", drafter, spaces, args.drafter_widths, args.repeats)


if __name__ == "__main__":
    guarded(main)
