"""`python -m benchmarks.native_vs_f32`: how far the native mode's logits are from the float32 reference.

Loads the target twice (native, and dequantized to float32), and on the benchmark's prompts (chat template as the
CLI applies it) reports the largest absolute logit difference over the prompt positions, whether the two agree on
each position's top token, and how many of the float32 model's greedy tokens the native model reproduces before
the first difference. Writes `<out>/native-vs-f32.md`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.run import PROMPTS, machine
from sampling import autoregressive_run
from utils.model_runner import common_prefix_length
from utils.models.model_loader import DEFAULT_TARGET, load_model, precision_summary
from utils.chat.session import chat_ids, stop_tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.native_vs_f32", description=__doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts-per-group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    native, tokenizer = load_model(args.target, "cpu", "auto")
    reference, _ = load_model(args.target, "cpu", "float32", onednn=True)
    stop = stop_tokens(tokenizer, native, chat=True)
    rows = []
    for group, prompts in json.loads(PROMPTS.read_text()).items():
        for i, prompt in enumerate(prompts[: args.prompts_per_group]):
            ids = chat_ids(tokenizer, prompt)
            with torch.no_grad():
                a = native(torch.tensor([ids])).logits[0]  # [positions, vocab]
                b = reference(torch.tensor([ids])).logits[0]
            ours = autoregressive_run(ids, native, args.new_tokens, None, stop, True).tokens
            theirs = autoregressive_run(ids, reference, args.new_tokens, None, stop, True).tokens
            same = common_prefix_length(ours, theirs)
            rows.append((group, i, float((a - b).abs().max()), float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                         same, len(theirs)))
            print(rows[-1], flush=True)
    lines = [f"Machine: {machine()}; {args.target}: {precision_summary(native)} vs float32 (dequantized).", "",
             "| group | prompt | max abs logit difference (prompt positions) | top-1 agreement (prompt positions) "
             "| greedy tokens equal before the first difference |", "|---|---|---|---|---|"]
    lines += [f"| {g} | {i} | {d:.3f} | {agree:.1%} | {same} of {n} |" for g, i, d, agree, same, n in rows]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "native-vs-f32.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
