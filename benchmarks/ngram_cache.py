"""`python -m benchmarks.ngram_cache`: what a persisted n-gram cache (`--ngram-cache FILE`) does for NASD.

On each group's prompts, in order, as successive one-prompt sessions: NASD with a fresh storage per prompt (the
default), against NASD whose storage is saved to a file after each prompt and loaded before the next (the
chat's `--ngram-cache`), so that prompt k drafts from what prompts 1..k-1 produced. The two runs of a prompt are
interleaved. Same configuration as the benchmark's NASD row (PICKY policy, n 4, gamma 8, target top-3 fillers),
greedy, cache on. Prints and writes `<out>/ngram-cache.md`: per group, acceptance (accepted / drafted over the
group, the first prompt excluded since both start empty there) and median tokens/s, and whether outputs agree.

Then a conversation on one topic (`benchmarks.turns`' follow-ups) through the chat's own session (its default
settings, NASD alone, cache on), twice, as two sessions: a storage fresh for each turn, against `--ngram-cache`
(kept across turns, saved, and loaded by the second session). The second session asks the same questions again:
the case a persisted cache is for, and the most favourable one.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.run import PROMPTS, machine
from benchmarks.turns import FOLLOW_UPS
from ngram_assisted import NGramStorage, nasd_run
from ngram_assisted.ngram_assisted import PICKY
from ngram_assisted.ngram_cache import load_storage, save_storage, tokenizer_fingerprint
from sampling import LoopSettings
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.chat.session import Session
from utils.chat.settings import Settings, untimed_gamma
from utils.models.model_loader import DEFAULT_TARGET, load_model, precision_summary
from benchmarks.cli import acceptance, at_least, choice_list, guarded, read_prompts, tool_parser, writable_folder


def main(argv=None) -> None:
    p = tool_parser("benchmarks.ngram_cache", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    prompts = read_prompts(None, str(PROMPTS))
    p.add_argument("--groups", type=choice_list(prompts), default=["code-editing", "chat"],
                   help="comma-separated groups of benchmarks/prompts.json (default code-editing,chat)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--turns", type=at_least(0), default=6,
                   help=f"turns of the one-topic conversation, at most {len(FOLLOW_UPS)} (0: skip it)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.turns > len(FOLLOW_UPS):
        p.error(f"--turns: at most {len(FOLLOW_UPS)} (the follow-ups this benchmark has)")
    out = writable_folder(p, "--out", args.out)  # before the run, not after it
    target, tokenizer = load_model(args.target)
    stop = stop_tokens(tokenizer, target, chat=True)
    fingerprint, vocab = tokenizer_fingerprint(tokenizer), target.config.vocab_size

    def run(ids, storage):
        loop = LoopSettings(max_gen_len=args.max_new_tokens, gamma=8, eos_tokens_id=stop)
        torch.manual_seed(0)
        start = time.perf_counter()
        result = nasd_run(ids, storage, target, None, loop, filler_top_k=3, use_cache=True, policy=PICKY)
        return result, time.perf_counter() - start

    run(chat_ids(tokenizer, "Hello"), NGramStorage(4, vocab))  # warm-up
    lines = [f"# Persisted n-gram cache for NASD ({machine()})", "",
             f"`python -m benchmarks.ngram_cache --groups {','.join(args.groups)} --max-new-tokens {args.max_new_tokens}`; "
             f"target {args.target} ({precision_summary(target)}).", "",
             "| group | prompts | acceptance fresh | acceptance persisted | drafted fresh / persisted | "
             "tokens/s fresh (median) | tokens/s persisted (median) | outputs equal |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for group in args.groups:
            path = Path(tmp) / f"{group}.ngram"
            totals = {"fresh": [0, 0, []], "persisted": [0, 0, []]}  # drafted, accepted, tokens/s
            equal = True
            for k, prompt in enumerate(prompts[group]):
                ids = chat_ids(tokenizer, prompt)
                outcome = {}
                for mode in ("fresh", "persisted") if k % 2 else ("persisted", "fresh"):
                    if mode == "persisted" and path.exists():
                        storage = load_storage(path, fingerprint, vocab)
                    else:
                        storage = NGramStorage(4, vocab)
                    result, seconds = run(ids, storage)
                    if mode == "persisted":
                        save_storage(path, storage, fingerprint)
                    outcome[mode] = result
                    if k > 0:
                        totals[mode][0] += result.drafted
                        totals[mode][1] += result.accepted
                        totals[mode][2].append(len(result.tokens) / seconds)
                    print(f"{group} #{k + 1} {mode}: accepted {result.accepted} of {result.drafted} drafted, "
                          f"{len(result.tokens) / seconds:.1f} tokens/s", flush=True)
                equal &= outcome["fresh"].tokens == outcome["persisted"].tokens
            f, q = totals["fresh"], totals["persisted"]
            lines.append(f"| {group} | 2-{len(prompts[group])} | {acceptance(f[1], f[0])} | {acceptance(q[1], q[0])} "
                         f"| {f[0]} / {q[0]} | {median(f[2])} | {median(q[2])} | {equal} |")
        if args.turns:
            lines += ["", *conversation(target, tokenizer, Path(tmp) / "conversation.ngram", args.turns)]
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "ngram-cache.md").write_text(text)


def median(rates: list[float]) -> str:
    """The median tokens/s; "–" for a group of one prompt, whose first prompt is left out of the figures."""
    return f"{statistics.median(rates):.1f}" if rates else "–"


def conversation(target, tokenizer, path: Path, turns: int) -> list[str]:
    import io

    lines = [f"One-topic conversation, {turns} turns, the chat's settings (NASD alone, gamma "
             f"{untimed_gamma(Settings())}, {Settings().length} tokens per answer, cache on):", "",
             "| session | acceptance fresh per turn | acceptance --ngram-cache | tokens/s fresh (median) | "
             "tokens/s --ngram-cache (median) | outputs equal |", "|---|---|---|---|---|---|"]
    for number in (1, 2):
        sessions = {}
        for mode in ("fresh", "persisted"):
            settings = Settings(use_cache=True)
            settings.enabled = {g: g == "ngram" for g in settings.enabled}
            sessions[mode] = Session(target, target, tokenizer, settings)
            sessions[mode].out = io.StringIO()
            if mode == "persisted":
                sessions[mode].use_ngram_cache(str(path))
        totals = {mode: [0, 0, []] for mode in sessions}
        equal = True
        for turn, prompt in enumerate(FOLLOW_UPS[:turns]):
            reports = {}
            for mode in ("fresh", "persisted") if turn % 2 else ("persisted", "fresh"):
                (reports[mode],) = sessions[mode].answer(prompt)
                r = reports[mode]
                totals[mode][0] += r.drafted
                totals[mode][1] += r.accepted
                totals[mode][2].append(r.tokens_per_s)
            equal &= reports["fresh"].token_ids == reports["persisted"].token_ids
            print(f"session {number} turn {turn + 1}: " + ", ".join(
                f"{m} {reports[m].accepted} accepted, {reports[m].tokens_per_s:.1f} tokens/s" for m in reports), flush=True)
        f, q = totals["fresh"], totals["persisted"]
        lines.append(f"| {number}{' (the same questions again)' if number == 2 else ''} | {acceptance(f[1], f[0])} | "
                     f"{acceptance(q[1], q[0])} | {median(f[2])} | {median(q[2])} | {equal} |")
    return lines


if __name__ == "__main__":
    guarded(main)
