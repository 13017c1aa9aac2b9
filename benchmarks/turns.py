"""`python -m benchmarks.turns`: first-token time over a conversation, with the KV cache kept across turns or not.

Two chat sessions on the target alone, cache on, `--length`-token answers, the same follow-up prompts: one keeps
each generator's KV cache from turn to turn (the chat's behaviour with /cache on), the other drops it before
every turn (each turn prefills the whole conversation). Turns are interleaved, A then B, so that machine noise
hits both alike (the order alternates), after a throwaway answer that warms the prefill path. Prints and writes `<out>/turns.md`: per turn, the prompt's tokens and each session's first-token
time and tokens/s, and whether the two answers are identical.
"""

from __future__ import annotations

import io

from benchmarks.run import machine
from utils.chat.session import Session
from utils.chat.settings import Settings
from utils.models.model_loader import DEFAULT_TARGET, load_model, precision_summary
from benchmarks.cli import at_least, guarded, tool_parser, writable_folder

FOLLOW_UPS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Make it ignore spaces and punctuation.",
    "Now make it case-insensitive too.",
    "Add a docstring with two examples.",
    "Write a pytest test for it.",
    "How would you make it faster for very long strings?",
    "Rewrite it without slicing.",
    "Summarise what we changed.",
]


def main(argv=None) -> None:
    p = tool_parser("benchmarks.turns", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--turns", type=at_least(1), default=6, help=f"follow-up turns, at most {len(FOLLOW_UPS)}")
    p.add_argument("--length", type=at_least(1), default=24)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.turns > len(FOLLOW_UPS):
        p.error(f"--turns: at most {len(FOLLOW_UPS)} (the follow-ups this benchmark has)")
    out = writable_folder(p, "--out", args.out)  # before the run, not after it
    target, tokenizer = load_model(args.target)
    sessions = {}
    for name in ("kept", "dropped"):
        settings = Settings(length=args.length, use_cache=True)
        settings.enabled = {g: g == "target" for g in settings.enabled}
        sessions[name] = Session(target, target, tokenizer, settings)
        sessions[name].out = io.StringIO()  # the answers are not the point here
    sessions["kept"].warm_up()
    throwaway = Session(target, target, tokenizer, sessions["kept"].settings)
    throwaway.out = io.StringIO()
    throwaway.answer(FOLLOW_UPS[0])  # the first prefill of a prompt's length is slower than later ones
    rows = []
    for turn, prompt in enumerate(FOLLOW_UPS[: args.turns], start=1):
        row = {"turn": turn, "prompt_tokens": len(sessions["kept"].encode(prompt))}
        for name in ("kept", "dropped") if turn % 2 else ("dropped", "kept"):
            if name == "dropped":
                sessions[name].kept.clear()
            (report,) = sessions[name].answer(prompt)
            row[name] = report
        rows.append(row)
        print(f"turn {turn}: {row['prompt_tokens']} prompt tokens · kept {row['kept'].first_token_s:.2f} s · "
              f"dropped {row['dropped'].first_token_s:.2f} s", flush=True)
    first = rows[0]["kept"].first_token_s
    lines = [
        f"# First-token time over a conversation ({machine()})",
        "",
        f"`python -m benchmarks.turns --turns {args.turns} --length {args.length}`; target {args.target} "
        f"({precision_summary(target)}), greedy, cache on, target alone.",
        "",
        "| turn | prompt tokens | first token, cache kept (s) | first token, cache dropped (s) | tokens/s kept | "
        "tokens/s dropped | answer tokens | same answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['kept'].first_token_s:.2f} | "
                     f"{r['dropped'].first_token_s:.2f} | {r['kept'].tokens_per_s:.1f} | "
                     f"{r['dropped'].tokens_per_s:.1f} | {r['kept'].tokens_generated} | "
                     f"{r['kept'].token_ids == r['dropped'].token_ids} |")
    last = rows[-1]["kept"].first_token_s
    lines += ["", f"Turn {rows[-1]['turn']} / turn 1, cache kept: {last / first:.2f}x "
              f"(dropped: {rows[-1]['dropped'].first_token_s / rows[0]['dropped'].first_token_s:.2f}x)."]
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "turns.md").write_text(text)


if __name__ == "__main__":
    guarded(main)
