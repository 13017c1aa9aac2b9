"""`python -m benchmarks.draft_stop_ab`: the draft-stop rules against fixed draft lengths in one process, each
prompt's methods run back to back and then again in reverse order, so that a host whose speed drifts (the 2-vCPU
machines of RESULTS.md) weighs on all of them alike. Greedy (or `--processor`: a repeat's methods seeded alike,
each repeat anew), cache on (or off: `--no-cache`, as the chat by default), the embedded pair as the chat loads
it; prints tokens/s per group (medians over prompts and repeats) and each rule against the best fixed length,
with its mean drafts a round and their acceptance. Several `--stop-gamma` caps run each rule at each.
`--prompts benchmarks/train_prompts.json` sweeps on the training prompts."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from sampling import DraftStopConfig, LoopSettings, autoregressive_run, make_draft_stop, speculative_run
from sampling.draft_cap import load_or_measure
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.chat.settings import describe_processor, parse_processor
from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, use_draft_vocab
from utils.models.kernel_choice import describe_cpu
from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
from benchmarks.cli import (at_least, count_list, guarded, in_turn, number, number_list, read_prompts,
                            tool_parser)

PROMPTS = Path(__file__).with_name("prompts.json")  # the held-out prompts of `python -m benchmarks`
FIXED = (1, 2, 3, 5)  # the fixed lengths by default (--gammas)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a count below 1 or a bound outside [0, 1) is refused in one line, before any loading."""
    parser = tool_parser("benchmarks.draft_stop_ab", __doc__)
    parser.add_argument("--repeats", type=at_least(1), default=2, help="runs of each prompt (every other one reversed)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=128)
    parser.add_argument("--stop-gamma", type=caps_list, default="6",
                        help="the rules' most drafts a round; several, comma-separated: each rule at each; auto: "
                             "the cap /gamma auto times on this machine (for confidence 0.9 with the cache on; "
                             "here every rule runs at it)")
    parser.add_argument("--entropy-bound", type=number(lambda b: DraftStopConfig("entropy", entropy_bound=b)),
                        default=DraftStopConfig().entropy_bound,
                        help="the entropy rule's bound, in [0, 1) (default 0.5)")
    parser.add_argument("--gammas", type=count_list(1), default=",".join(map(str, FIXED)), help="fixed draft lengths, comma-separated")
    parser.add_argument("--confidences", type=number_list(lambda p: DraftStopConfig("confidence", confidence=p)),
                        default=[], help="confidence rules to run too, thresholds in [0, 1) comma-separated")
    parser.add_argument("--no-cache", dest="use_cache", action="store_false", help="every pass reads the whole sequence")
    parser.add_argument("--prompts", default=str(PROMPTS), help="prompts by group (default: the held-out ones)")
    parser.add_argument("--seed", type=at_least(0), default=0,
                        help="sampled: the first repeat's seed (repeat i samples from seed + i)")
    parser.add_argument("--processor", default="greedy",
                        help="as the CLI's, e.g. 'nucleus 0.7 0.9'; sampled answers differ between methods, so their "
                             "tokens are not compared")
    args = parser.parse_args(argv)
    try:
        args.processor = parse_processor(args.processor.split())
    except ValueError as error:
        parser.error(f"--processor: {error}")
    args.groups = read_prompts(parser, args.prompts)
    if "auto" in args.stop_gamma and not args.use_cache:
        parser.error("--stop-gamma auto is the cap timed with the cache on: give numbers with --no-cache")
    return args


def caps_list(text: str) -> list[int | str]:
    """--stop-gamma: integers >= 1 and `auto`, comma-separated."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if words and set(words) == {"auto"}:
        return ["auto"]
    try:
        numbers = count_list(1)(",".join(w for w in words if w != "auto"))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 or auto, got {text!r}") from None
    return numbers + ["auto"] * ("auto" in words)


def drafts_and_acceptance(rounds: int, drafted: int, accepted: int) -> str:
    """A rule's mean drafts a round and the share of them accepted, over a group's runs."""
    return f"{drafted / max(rounds, 1):.1f} drafts a round, {accepted / max(drafted, 1):.0%} accepted"


def rule_configs(args) -> dict[str, DraftStopConfig]:
    """The rules a run compares, by name; a threshold's name is its exact decimal (repr), since `{p:g}`'s six digits
    made two close thresholds one name, and one of them was not run."""
    return {"entropy": DraftStopConfig("entropy", entropy_bound=args.entropy_bound),
            "learned": DraftStopConfig("learned"),
            **{f"confidence {p!r}": DraftStopConfig("confidence", confidence=p) for p in args.confidences}}


def main() -> None:
    args = parse_args()

    target, tokenizer = load_model(DEFAULT_TARGET, progress=False)
    drafter, drafter_tokenizer = load_model(DEFAULT_DRAFTER, int4_drafter=True, progress=False)
    use_draft_vocab(drafter, drafter_tokenizer, DEFAULT_DRAFT_VOCAB)
    stop = stop_tokens(tokenizer, target, chat=True)
    configs = rule_configs(args)
    if "auto" in args.stop_gamma:
        cap, costs = load_or_measure(target, drafter, note=print)
        print(f"auto: at most {cap} drafts ({costs.describe()})")
    caps = list(dict.fromkeys(cap if c == "auto" else c for c in args.stop_gamma))
    # a rule's name carries its most drafts a round where several caps are compared
    named = {(f"{name} <={cap}" if len(caps) > 1 else name): (config, cap)
             for name, config in configs.items() for cap in caps}
    # one rule object per rule for the whole run, as a chat keeps it: the learned rule's measurements carry
    rules = {name: make_draft_stop(config, drafter) for name, (config, _) in named.items()}
    methods = ["ar", *(f"g{g}" for g in args.gammas), *rules]

    def run(method: str, ids: list[int], seed: int = 0):
        n = args.max_new_tokens
        # each method samples from the same seed, as the chat's generators do; each repeat from its own, so that
        # sampled repeats weigh several answers instead of timing one answer again
        torch.manual_seed(seed)
        if method == "ar":
            return autoregressive_run(ids, target, n, args.processor, stop, args.use_cache)
        gamma = named[method][1] if method in named else int(method[1:])
        settings = LoopSettings(max_gen_len=n, gamma=gamma, eos_tokens_id=stop)
        return speculative_run(ids, drafter, target, args.processor, settings, use_cache=args.use_cache,
                               draft_stop=rules.get(method))

    for method in methods:  # warm-up: one-time costs out of the figures
        run(method, chat_ids(tokenizer, "Hello"))
    print(f"{describe_cpu()}; {describe_processor(args.processor)}, cache {'on' if args.use_cache else 'off'}, "
          f"{args.max_new_tokens} tokens, rules at most {'/'.join(map(str, caps))} drafts, prompts "
          f"{Path(args.prompts).name}")
    for group, prompts in args.groups.items():
        rates: dict[str, list[float]] = {m: [] for m in methods}
        counts = {m: [0, 0, 0] for m in methods}  # rounds, drafted, accepted: the rules' mean length and acceptance
        for prompt in prompts:
            ids = chat_ids(tokenizer, prompt)
            for repeat in range(args.repeats):
                reference = None
                for method in in_turn(methods, repeat):
                    start = time.perf_counter()
                    result = run(method, ids, seed=args.seed + repeat)
                    rates[method].append(len(result.tokens) / (time.perf_counter() - start))
                    for i, n in enumerate((result.rounds, result.drafted, result.accepted)):
                        counts[method][i] += n
                    if reference is None or not args.processor.is_greedy:
                        reference = result.tokens
                    elif result.tokens != reference:  # lossless: every method writes the same greedy answer
                        raise SystemExit(f"{method} wrote another answer than {methods[0]} on a {group} prompt")
        median = {m: statistics.median(v) for m, v in rates.items()}
        best = max((f"g{g}" for g in args.gammas), key=median.get)
        versus = ", ".join(f"{rule} {median[rule] / median[best] - 1:+.1%} ({drafts_and_acceptance(*counts[rule])})"
                           for rule in rules)
        print(f"{group}: " + " ".join(f"{m} {median[m]:.2f}" for m in methods) + f" | best fixed {best}; {versus}")


if __name__ == "__main__":
    guarded(main)
