"""`python -m benchmarks.drafters`: what each drafter variant costs and how often it agrees with the target.

A drafter's worth is its cost per draft against how often its draft is the target's token. For greedy decoding
the second is exact without running speculative decoding at all: the target's greedy answer to each benchmark
prompt is computed once, then each drafter reads prompt + answer in one pass, and agreement is the share of
answer positions where its argmax is the target's next token (a draft is kept iff it matches). The cost is one
cached forward of the drafter over 1 and over 9 new tokens (`benchmarks.kernels.pass_costs`), the variants taking
turns, so all five are held at once (16.0 GB at peak with the 1.5B target's answers, Zen 5).
"""

from __future__ import annotations

import json
import statistics

import torch

from benchmarks.kernels import pass_costs
from benchmarks.run import PROMPTS
from sampling import autoregressive_run
from utils.models.cpu_kernels import quantize_int8, use_onednn_linear
from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from benchmarks.cli import EVEN, at_least, guarded, tool_parser

# variant -> linear layers kept in float32 (None: no int8 at all)
VARIANTS = {
    "float32": None,
    "int8, every linear layer": (),
    "int8, lm_head kept float32": ("lm_head",),
    "int8, down_proj kept float32 (the default)": ("down_proj",),
    "int8, lm_head and down_proj kept float32": ("lm_head", "down_proj"),
}


def target_answers(target_spec: str, prompts: dict[str, list[str]], n: int, tokens: int):
    """(group, prompt ids, the target's greedy answer) for the first n prompts of each group."""
    target, tokenizer = load_model(target_spec, "cpu", "float32", onednn=True)
    stop = stop_tokens(tokenizer, target, chat=True)
    out = []
    for group, texts in prompts.items():
        for text in texts[:n]:
            ids = chat_ids(tokenizer, text)
            out.append((group, ids, autoregressive_run(ids, target, tokens, None, stop, True).tokens))
    return out


@torch.no_grad()
def agreement(drafter: torch.nn.Module, ids: list[int], answer: list[int]) -> float:
    logits = drafter(input_ids=torch.tensor([ids + answer])).logits[0, len(ids) - 1 : -1]  # [answer, vocab]
    return (logits.argmax(-1) == torch.tensor(answer)).float().mean().item()


def main(argv=None) -> None:
    p = tool_parser("benchmarks.drafters", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--prompts-per-group", type=at_least(1), default=4)
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--repeats", type=at_least(1), default=4, help=EVEN)
    args = p.parse_args(argv)
    answers = target_answers(args.target, json.loads(PROMPTS.read_text()), args.prompts_per_group, args.max_new_tokens)
    groups = list(dict.fromkeys(group for group, _, _ in answers))
    from utils.models.kernel_choice import describe_cpu

    print(f"Machine: {describe_cpu()}")  # float32 on the CPU, whatever GPU is beside it
    print(f"{args.drafter} against {args.target}'s greedy answers ({len(answers)} prompts in {len(groups)} groups, "
          f"{args.max_new_tokens} tokens); all variants on oneDNN for their float32 layers\n")
    print("| drafter | 1 token | 9 tokens | " + " | ".join(f"agreement, {g}" for g in groups) + " |")
    print("|---|---|---|" + "---|" * len(groups))
    drafters = {}
    for label, keep_float in VARIANTS.items():  # all at once, so that their passes can take turns
        drafters[label], _ = load_model(args.drafter, "cpu", "float32")
        if keep_float is not None:
            quantize_int8(drafters[label], keep_float)
        use_onednn_linear(drafters[label])
    costs = pass_costs(drafters, args.repeats)
    for label, drafter in drafters.items():
        agree = {g: statistics.mean(agreement(drafter, ids, ans) for grp, ids, ans in answers if grp == g)
                 for g in groups}
        print(f"| {label} | {costs[label][1]:.0f} ms | {costs[label][9]:.0f} ms | "
              + " | ".join(f"{agree[g]:.2f}" for g in groups) + " |", flush=True)


if __name__ == "__main__":
    guarded(main)
