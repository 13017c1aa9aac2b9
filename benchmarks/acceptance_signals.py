"""`python -m benchmarks.acceptance_signals`: how well each signal a draft-length rule could read tells an accepted
draft from a rejected one (issue 23), as the AUC on the held-out prompts of a small model fitted on the training
prompts.

A rule gains over a fixed length only as far as it foresees rejections. The oracle of `benchmarks.draft_replay`
foresees them all; this asks what the signals at hand foresee. At each answer position (greedy, the embedded pair,
the accepted path as in `train_acceptance_head`), the label is whether the drafter's greedy draft equals the
target's token, and the signals are:
- the drafter's distribution: its top probability (the confidence rule's signal), the second one, the entropy;
- the drafter's past: whether its draft at the previous position was right, and its distribution there;
- the target's distribution at the previous position (a rule knows it for a round's first draft);
- the target's distribution at the drafted position itself: no rule can read it before verifying, so it bounds
  what any feature of the target's confidence could add.

    python -m benchmarks.acceptance_signals      # ~3 minutes on the Zen 5 of RESULTS.md (two passes per prompt)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from benchmarks.train_acceptance_head import HERE, Collector, auc
from benchmarks.train_acceptance_head import data_args as data_source_args
from sampling.draft_stop import entropy
from benchmarks.cli import at_least, guarded, tool_parser

# column groups of `signals()`
DRAFTER = [0, 1, 2]  # top probability, second probability, entropy
PAST = [3, 4, 5, 6]  # previous position: drafter right, its top, second, entropy
TARGET_BEFORE = [7, 8]  # the target's top probability and entropy at the previous position
TARGET_AT = [9, 10]  # the same at the drafted position (not causal)
SETS = {
    "drafter top probability": [0],
    "drafter distribution": DRAFTER,
    "+ drafter's past": DRAFTER + PAST,
    "+ target before": DRAFTER + TARGET_BEFORE,
    "+ target at the draft (bound)": DRAFTER + TARGET_AT,
}


def distribution(logits: Tensor) -> Tensor:
    """logits [n, vocab] -> [n, 3]: top probability, second probability, entropy in nats."""
    probs = torch.softmax(logits.float(), dim=-1)
    top2 = probs.topk(2, dim=-1).values
    return torch.cat([top2, entropy(probs)], dim=-1)  # [n, 2], [n, 1]


def signals(drafter: Tensor, target: Tensor, labels: Tensor) -> Tensor:
    """drafter [n, 3] at the positions drafted, target [n + 1, 3] from the position before the first, labels [n]
    -> [n, 11] (the column groups above). The first position's past is taken as a right draft like itself."""
    previous = torch.cat([drafter[:1], drafter[:-1]])
    right_before = torch.cat([torch.ones(1), labels[:-1]])[:, None]
    return torch.cat([drafter, right_before, previous, target[:-1, [0, 2]], target[1:, [0, 2]]], dim=-1)


def fit(x: Tensor, y: Tensor, columns: list[int], seed: int = 0, epochs: int = 500):
    """A small MLP on `columns` of standardised `x`, full-batch Adam: -> a scoring function."""
    torch.manual_seed(seed)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-4)
    model = torch.nn.Sequential(torch.nn.Linear(len(columns), 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = ((x - mean) / std)[:, columns]
    for _ in range(epochs):
        optimiser.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(inputs).squeeze(-1), y).backward()
        optimiser.step()
    return lambda z: model(((z - mean) / std)[:, columns]).squeeze(-1).detach()


def table(train: dict[str, list[tuple]], held: dict[str, list[tuple]]) -> list[str]:
    """(signals, labels) per answer by group -> markdown rows: per held-out group, the AUC of each signal set."""
    x, y = (torch.cat([part[i] for parts in train.values() for part in parts]) for i in (0, 1))
    scorers = {name: fit(x, y, columns) for name, columns in SETS.items()}
    rows = ["| group | positions | accepted | " + " | ".join(SETS) + " |", "|---" * (len(SETS) + 3) + "|"]
    for group, parts in held.items():
        hx, hy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        rows.append(f"| {group} | {len(hy)} | {hy.mean():.0%} | "
                    + " | ".join(f"{auc(score(hx), hy):.3f}" for score in scorers.values()) + " |")
    return rows


@torch.no_grad()
def collect(models: Collector, prompts: dict[str, list[str]], tokens: int) -> dict[str, list[tuple]]:
    """Each prompt's (signals, labels): the target answers greedily, then each model reads prompt and answer once."""
    from sampling import autoregressive_run
    from utils.chat.prompt_tokens import chat_ids

    data = {}
    for group, texts in prompts.items():
        data[group] = []
        for text in texts:
            ids = chat_ids(models.tokenizer, text)
            answer = autoregressive_run(ids, models.target, tokens, None, models.stop, True).tokens
            seq = torch.tensor([ids + answer])
            first, last = len(ids), len(ids) + len(answer) - 1  # positions whose successor is answer[1:]
            drafted = models.drafter_pass(ids + answer)[0][first:last]  # [n, vocab], as the chat drafts
            labels = (drafted.argmax(-1) == torch.tensor(answer[1:])).float()  # [n]
            target_side = distribution(models.target(input_ids=seq).logits[0, first - 1 : last])  # [n + 1, 3]
            data[group].append((signals(distribution(drafted), target_side, labels), labels))
    return data


def main(argv=None) -> None:
    from benchmarks.run import machine

    p = tool_parser("benchmarks.acceptance_signals", __doc__)
    p.add_argument("--train-tokens", type=at_least(1), default=96)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    args = p.parse_args(argv)
    for name in ("train_tokens", "max_new_tokens"):
        if getattr(args, name) < 2:  # a label needs a token after the first
            p.error(f"--{name.replace('_', '-')} must be at least 2")
    models = Collector(data_source_args([]))  # the embedded pair: the chat's 4-bit drafter, its shortlist head
    train = collect(models, json.loads(Path(HERE / "train_prompts.json").read_text()), args.train_tokens)
    held = collect(models, json.loads(Path(HERE / "prompts.json").read_text()), args.max_new_tokens)
    print(f"machine: {machine()}\nAUC on the held-out prompts (fitted on the training prompts):")
    print("\n".join(table(train, held)))


if __name__ == "__main__":
    guarded(main)
