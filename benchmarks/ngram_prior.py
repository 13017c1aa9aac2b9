"""NASD's shipped prior (`ngram_assisted/ngram_prior.py`): built here, and measured against NASD without it.

`python -m benchmarks.ngram_prior build` answers `benchmarks/prior_prompts.json` (no task of the held-out
`prompts.json`) greedily with the embedded target, the cache on, and counts each answer with the three template
tokens before it (so the prior knows how answers begin) into a basic storage of n 4, saved as
`ngram_assisted/priors/<tokenizer fingerprint>.json.gz` with where it came from.

`python -m benchmarks.ngram_prior measure` runs NASD as the chat does (gamma 6, its policy for the cache setting,
top-3 fillers, a fresh storage a prompt) with and without the prior, in turns, on the held-out prompts: the cache
off at the chat's 35 tokens and the cache on at 128. Prints, per group: seconds, target passes, drafts kept of
drafted, and whether every output equals the other's. `--against FILE` puts another prior file (an earlier build,
kept aside) in place of "without", to compare two builds.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.run import PROMPTS, machine
from benchmarks.train_acceptance_head import commit
from ngram_assisted import NGramStorage, nasd_run
from ngram_assisted.ngram_cache import NGramCacheError, load_storage, save_storage
from ngram_assisted.ngram_prior import prior_fingerprint, prior_path, shipped_prior
from sampling import LoopSettings, autoregressive_run
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.chat.settings import Settings, untimed_gamma
from utils.models.model_loader import DEFAULT_TARGET, load_model
from benchmarks.cli import at_least, guarded, in_turn, tool_parser

PRIOR_PROMPTS = Path(__file__).with_name("prior_prompts.json")
PRIOR_N = Settings().ngram_n  # the chat's storage n (4): contexts of up to 3 tokens
ANSWER_TOKENS = 192  # counted per answer: past the chat's 35 and the benchmark's 128
LEAD = PRIOR_N - 1  # template tokens counted before each answer ("<|im_start|>assistant\n"): how answers begin


def prompts_of(path: Path) -> dict[str, list[str]]:
    return {group: prompts for group, prompts in json.loads(path.read_text()).items() if not group.startswith("_")}


def build(args) -> None:
    target, tokenizer = load_model(args.target)
    stop = stop_tokens(tokenizer, target, chat=True)
    storage = NGramStorage(PRIOR_N, target.config.vocab_size)
    counted = 0
    started = time.perf_counter()
    for group, prompts in prompts_of(PRIOR_PROMPTS).items():
        for prompt in prompts:
            ids = chat_ids(tokenizer, prompt)
            answer = autoregressive_run(ids, target, ANSWER_TOKENS, None, stop, use_cache=True).tokens
            storage.add_sequence(ids[-LEAD:] + answer)
            counted += len(answer)
    fingerprint = prior_fingerprint(tokenizer)
    about = {"made_by": "python -m benchmarks.ngram_prior build", "commit": commit(), "target": args.target,
             "prompts": PRIOR_PROMPTS.name, "prompts_sha256": hashlib.sha256(PRIOR_PROMPTS.read_bytes()).hexdigest(),
             "decoding": f"greedy, cache on, at most {ANSWER_TOKENS} tokens an answer, {LEAD} template tokens "
                         "before it",
             "answer_tokens": counted, "machine": machine()}
    path = prior_path(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_storage(path, storage, fingerprint, about)
    contexts = sum(len(c) for c in storage.counts.values())
    print(f"{counted} answer tokens, {contexts} contexts, {path.stat().st_size} bytes -> {path} "
          f"({time.perf_counter() - started:.0f} s)")


def measure(args) -> None:
    target, tokenizer = load_model(args.target)
    stop = stop_tokens(tokenizer, target, chat=True)
    vocab = target.config.vocab_size
    fingerprint = prior_fingerprint(tokenizer)
    try:  # a damaged file, or one of another tokenizer: one line
        prior = shipped_prior(fingerprint, vocab)
        other = load_storage(args.against, fingerprint, vocab, padded=True) if args.against else None  # "without"
    except NGramCacheError as error:
        raise SystemExit(f"python -m benchmarks.ngram_prior: {error}") from None
    if prior is None:
        raise SystemExit("no prior for this tokenizer: python -m benchmarks.ngram_prior build")
    without = f"against {Path(args.against).name}" if args.against else "without"
    chat = Settings()

    def run(ids, use_cache: bool, length: int, with_prior: bool):
        loop = LoopSettings(max_gen_len=length, gamma=untimed_gamma(chat), eos_tokens_id=stop)
        start = time.perf_counter()
        result = nasd_run(ids, NGramStorage(chat.ngram_n, vocab), target, None, loop, chat.top_k_filler, use_cache,
                          prior=prior if with_prior else other)
        return result, time.perf_counter() - start

    for use_cache in (False, True):  # one-time costs of either path and variant out of the figures
        for with_prior in (False, True):
            run(chat_ids(tokenizer, "Hello"), use_cache, 4, with_prior)
    print(f"# NASD with and without its prior ({machine()})\n")
    against = f" --against {args.against}" if args.against else ""
    print(f"`python -m benchmarks.ngram_prior measure --repeats {args.repeats}{against}`: held-out prompts, greedy, "
          f"gamma {untimed_gamma(chat)}, the chat's policy per cache setting; seconds summed per group (median over "
          "repeats), target passes, drafts kept / drafted\n")
    print(f"| cache, tokens | group | {without} | with the prior | time ratio | same tokens |\n|---|---|---|---|---|---|")
    for use_cache, length in ((False, 35), (True, 128)):
        for group, prompts in prompts_of(PROMPTS).items():
            seconds = {False: [], True: []}
            stats, same = {}, True
            for repeat in range(args.repeats):
                totals = {False: 0.0, True: 0.0}
                for i, prompt in enumerate(prompts):
                    ids = chat_ids(tokenizer, prompt)
                    outs = {}
                    for with_prior in in_turn([False, True], repeat + i):  # each goes first half the time
                        result, took = run(ids, use_cache, length, with_prior)
                        totals[with_prior] += took
                        outs[with_prior] = result
                        if repeat == 0:
                            s = stats.setdefault(with_prior, [0, 0, 0])
                            s[0] += result.target_calls
                            s[1] += result.accepted
                            s[2] += result.drafted
                    same &= outs[False].tokens == outs[True].tokens
                for with_prior in (False, True):
                    seconds[with_prior].append(totals[with_prior])
            cells = [f"{statistics.median(seconds[w]):.2f} s, {stats[w][0]} passes, {stats[w][1]}/{stats[w][2]}"
                     for w in (False, True)]
            ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
            print(f"| {'on' if use_cache else 'off'}, {length} | {group} | {cells[0]} | {cells[1]} | {ratio:.3f} | "
                  f"{'yes' if same else 'NO'} |", flush=True)


def main(argv=None) -> None:
    p = tool_parser("benchmarks.ngram_prior", __doc__)
    p.add_argument("action", choices=("build", "measure"))
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--repeats", type=at_least(1), default=None, help="measure: turns of each prompt (default 3)")
    p.add_argument("--against", default=None, metavar="FILE", help="measure: this prior file instead of none")
    args = p.parse_args(argv)
    for flag in ("against", "repeats"):
        if args.action == "build" and getattr(args, flag) is not None:
            p.error(f"--{flag} goes with measure")
    args.repeats = args.repeats or 3
    torch.manual_seed(0)
    build(args) if args.action == "build" else measure(args)


if __name__ == "__main__":
    guarded(main)
