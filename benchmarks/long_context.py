"""`python -m benchmarks.long_context`: long prompts, measured two ways.

1. KV policies (`--kv-policy` under `--kv-budget`): a needle test. A prompt of about 1k, 2k or 4k tokens is the
   project's own source code with one line (`SECRET_BUILD_NUMBER = 48213`) buried at a depth, and a question
   about it at the end. For full attention and each policy at 25% and 50% of the prompt: whether the greedy
   answer holds the number, how many of its tokens equal full attention's before the first difference,
   first-token time, decoding tokens/s and the peak bytes held by the KV cache. A plot of retrieval against the
   budget per policy (as kvpress plots score against compression ratio).
2. `--drafter-window`: speculative decoding's end-to-end time (both prefills included), acceptance and output
   against plain decoding, with the full drafter and with windows.

Greedy, cache on, the chat template, the machine's threads. Every figure names the CPU it came from.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from sampling import LoopSettings, autoregressive_run, speculative_run
from utils.caching import KV_BUDGET_ATTRIBUTE, KV_POLICY_ATTRIBUTE, KV_POLICIES, SINKS
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.chat.settings import Settings
from utils.logits_processor import GreedyProcessor
from utils.model_runner import ModelRunner, common_prefix_length
from utils.models.kernel_choice import describe_cpu
from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
from utils.models.rowwise_attention import use_kv_budget
from benchmarks.cli import acceptance, at_least, guarded, in_turn, number, tool_parser, writable_folder

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("sampling", "utils", "ngram_assisted") for p in sorted((ROOT / folder).rglob("*.py"))]
NEEDLE = "SECRET_BUILD_NUMBER = {value}  # the build number the release notes quote"
QUESTION = "What is the value of SECRET_BUILD_NUMBER in the code above? Answer with the number only."
# The drafter-window runs ask for a longer answer that the latest code decides, as TriForce's long-context
# generation does: a needle's number, 5 tokens seen only far back, measures no drafter.
EXPLAIN = "Explain what the last function in the code above does."


def needle_prompt(tokenizer, tokens: int, depth: float, value: int, question: str = QUESTION) -> list[int]:
    """About `tokens` chat-template ids: source code with the needle line at `depth` (0: top, 1: bottom)."""
    code_ids = tokenizer("\n".join(p.read_text() for p in SOURCES))["input_ids"]
    lines = tokenizer.decode(code_ids[: max(tokens - 80, 16)]).split("\n")[:-1]  # whole lines only
    at = round(depth * len(lines))
    lines.insert(at, NEEDLE.format(value=value))
    return chat_ids(tokenizer, "```python\n" + "\n".join(lines) + "\n```\n" + question)


def set_policy(models, policy: str | None, budget: int = 0) -> None:
    """A KV budget under `policy` for every model, or full attention (None)."""
    for model in models:
        for name in (KV_BUDGET_ATTRIBUTE, KV_POLICY_ATTRIBUTE):
            if hasattr(model.config, name):
                delattr(model.config, name)
        if policy is not None:
            use_kv_budget(model, budget, policy=policy)


def kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


class PeakRunner(ModelRunner):
    """Records the most bytes its KV cache held after any pass (the prompt is read in the chat's chunks; SnapKV
    compresses after the whole prompt, streaming evicts between chunks)."""

    peak = 0

    def forward(self, new_ids, k, positions):
        out = super().forward(new_ids, k, positions)
        self.peak = max(self.peak, kv_bytes(self.cache))
        return out


def answer(model, ids: list[int], length: int, stop: list[int]) -> dict:
    runner = PeakRunner(model, use_cache=True, prefill_chunk=Settings().prefill_chunk)
    first: list[float] = []
    start = time.perf_counter()
    result = autoregressive_run(ids, model, length, GreedyProcessor(), stop, True,
                                on_round=lambda r: first or first.append(time.perf_counter()), runner=runner)
    end = time.perf_counter()
    decoded = len(result.tokens) - 1
    return {"tokens": result.tokens, "first_token_s": first[0] - start,
            "decode_tokens_per_s": decoded / (end - first[0]) if decoded > 0 else None,
            "peak_kv_mib": runner.peak / 2**20}


def depth(value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"a depth is from 0 (the top) to 1 (the bottom), got {value:g}")


def budget_share(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"a budget's share is above 0 and at most 1, got {value:g}")


def warm_up(target, drafter, tokenizer, gamma: int) -> None:
    """A short answer of each path, untimed: the first call of a pass shape pays one-time costs (the kernels'
    first use, allocations) that would land in the first row's first-token time."""
    ids = chat_ids(tokenizer, "Hello")
    stop = stop_tokens(tokenizer, target, chat=True)
    answer(drafter, ids, 4, stop)
    answer(target, ids, 4, stop)
    speculative_run(ids, drafter, target, GreedyProcessor(), LoopSettings(max_gen_len=4, gamma=gamma,
                                                                          eos_tokens_id=stop), use_cache=True)


def needle_runs(model, tokenizer, args) -> list[dict]:
    stop = stop_tokens(tokenizer, model, chat=True)
    rows = []
    for tokens in args.lengths:
        for d, depth in enumerate(args.depths):
            value = 48213 + 1111 * d
            ids = needle_prompt(tokenizer, tokens, depth, value)
            full = None  # full attention's answer, which every policy's is compared with
            for policy, share in [(None, 1.0)] + [(p, s) for s in args.shares for p in args.policies]:
                budget = int(len(ids) * share)
                set_policy([model], policy, budget)
                run = answer(model, ids, args.answer, stop)
                answer_ids = run.pop("tokens")
                full = answer_ids if full is None else full
                text = tokenizer.decode(answer_ids, skip_special_tokens=True)
                row = {"prompt_tokens": len(ids), "depth": depth, "policy": policy or "full", "share": share,
                       "budget": budget if policy else len(ids), "retrieved": str(value) in text, "answer": text,
                       "agreement": common_prefix_length(answer_ids, full), **run}
                rows.append(row)
                print(f"{len(ids):5d} tok depth {depth:.2f} {row['policy']:>9} {share:4.0%} "
                      f"retrieved {row['retrieved']!s:5} agree {row['agreement']:3d} first {run['first_token_s']:6.1f} s "
                      f"peak KV {run['peak_kv_mib']:6.1f} MiB  {text[:40]!r}", flush=True)
    set_policy([model], None)
    return rows


def window_runs(target, drafter, tokenizer, args) -> list[dict]:
    """Target AR, SD with the whole drafter and SD with each window, at each prompt length. Their order alternates
    from one length to the next (`in_turn`), so the first run at a new length (it pays what a new length costs
    first) and a slow spell of the host are not always the same method's."""
    stop = stop_tokens(tokenizer, target, chat=True)
    runs = list(dict.fromkeys([None, 0, *args.windows]))  # None: the target alone; 0: the whole drafter; once each
    rows = []
    for index, tokens in enumerate(args.window_lengths):
        ids = needle_prompt(tokenizer, tokens, 0.5, 48213, EXPLAIN)
        timed = {}
        for window in in_turn(runs, index):
            start = time.perf_counter()
            if window is None:
                result = autoregressive_run(ids, target, args.window_answer, GreedyProcessor(), stop, True)
            else:
                settings = LoopSettings(max_gen_len=args.window_answer, gamma=args.gamma, eos_tokens_id=stop)
                result = speculative_run(ids, drafter, target, GreedyProcessor(), settings, use_cache=True,
                                         drafter_window=window)
            timed[window] = (result, time.perf_counter() - start)
        ar = timed[None][0].tokens
        for window in runs:  # table order
            result, seconds = timed[window]
            if window is None:
                rows.append({"prompt_tokens": len(ids), "method": "target AR", "seconds": seconds, "equal_to_ar": True})
                print(f"{len(ids):5d} tok  target AR          {seconds:7.1f} s", flush=True)
                continue
            rows.append({"prompt_tokens": len(ids), "method": f"SD window {window}" if window else "SD full drafter",
                         "window": window, "seconds": seconds,
                         "acceptance": result.acceptance_rate if result.drafted else None,  # none drafted: undefined
                         "equal_to_ar": result.tokens == ar, "tokens": len(result.tokens)})
            print(f"{len(ids):5d} tok  {rows[-1]['method']:<18} {seconds:7.1f} s  acceptance "
                  f"{acceptance(result.accepted, result.drafted)}  equal to AR {result.tokens == ar}", flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    full = [r["retrieved"] for r in rows if r["policy"] == "full"]
    for policy in sorted({r["policy"] for r in rows} - {"full"}):
        shares = sorted({r["share"] for r in rows if r["policy"] == policy})
        rates = [sum(r["retrieved"] for r in rows if r["policy"] == policy and r["share"] == s)
                 / max(sum(1 for r in rows if r["policy"] == policy and r["share"] == s), 1) for s in shares]
        ax.plot([*shares, 1.0], [*rates, sum(full) / max(len(full), 1)], marker="o", label=policy)
    ax.set_xlabel("KV budget / prompt length (1.0: full attention)")
    ax.set_ylabel("needles retrieved")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    lengths = sorted({r["prompt_tokens"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    ax.set_title(f"Needle retrieval: prompts of {', '.join(map(str, lengths))} tokens, depths "
                 f"{', '.join(f'{d:g}' for d in depths)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = tool_parser("benchmarks.long_context", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--needle-model", choices=("target", "drafter"), default="drafter",
                   help="the model of the needle test (the drafter is ~3x cheaper to run on a CPU)")
    p.add_argument("--lengths", type=at_least(1), nargs="*", default=[1024, 2048, 4096])
    p.add_argument("--depths", type=number(depth), nargs="+", default=[0.1, 0.5, 0.9],
                   help="where the needle is, from 0 (the top) to 1 (the bottom)")
    p.add_argument("--shares", type=number(budget_share), nargs="+", default=[0.25, 0.5],
                   help="budgets, as shares of the prompt, above 0 and at most 1")
    p.add_argument("--policies", nargs="+", default=list(KV_POLICIES), choices=KV_POLICIES)
    p.add_argument("--window-lengths", type=at_least(1), nargs="*", default=[2048, 4096])
    p.add_argument("--windows", type=at_least(2 * SINKS), nargs="+", default=[256, 512])
    p.add_argument("--gamma", type=at_least(1), default=3)
    p.add_argument("--answer", type=at_least(1), default=16, help="needle test: new tokens per answer at most")
    p.add_argument("--window-answer", type=at_least(1), default=48, help="drafter window: new tokens per answer at most")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long-context"))
    args = p.parse_args(argv)
    if not args.lengths and not args.window_lengths:  # else both models load and an empty `complete` file is written
        p.error("nothing to run: give --lengths (the needle test) or --window-lengths (the drafter window), or both")
    if args.lengths and min(args.lengths) * min(args.shares) < 2 * SINKS:  # the prompt holds ~length tokens
        p.error(f"--shares: {min(args.shares):g} of a {min(args.lengths)}-token prompt is under the "
                f"{2 * SINKS} positions a KV budget needs at least")
    out = writable_folder(p, "--out", args.out)
    args.out = str(out)
    print(f"CPU: {describe_cpu()}", flush=True)
    target, tokenizer = load_model(args.target, device="cpu")
    drafter, _ = load_model(args.drafter, device="cpu", int4_drafter=True)
    if args.lengths:  # the prompts hold fewer tokens than asked (whole lines, the template): the real budget
        shortest = len(needle_prompt(tokenizer, min(args.lengths), 0.5, 48213))
        if int(shortest * min(args.shares)) < 2 * SINKS:
            p.error(f"--shares: {min(args.shares):g} of the {shortest}-token prompt is under the {2 * SINKS} positions "
                    "a KV budget needs at least")
    warm_up(target, drafter, tokenizer, args.gamma)
    # written after each part, so that a later part's failure keeps the earlier ones: `complete` says which
    results = {"cpu": describe_cpu(), "args": vars(args), "complete": False}
    if args.lengths:
        results["needles"] = needle_runs(target if args.needle_model == "target" else drafter, tokenizer, args)
        try:
            plot(results["needles"], out / "retrieval.png")
        except ImportError:  # matplotlib is the optional [bench] extra; the figures are written
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.window_lengths:
        results["drafter_window"] = window_runs(target, drafter, tokenizer, args)
    results["complete"] = True
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}", flush=True)


if __name__ == "__main__":
    guarded(main)
