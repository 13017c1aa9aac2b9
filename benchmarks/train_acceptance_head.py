"""`python -m benchmarks.train_acceptance_head`: trains the acceptance head of `--draft-stop learned` for a drafter.

Data: the target answers each prompt of `benchmarks/train_prompts.json` greedily (the project's own prompts, not
the benchmark's); the drafter then reads prompt and answer in one pass. At every answer position after the
first, the drafter's last hidden state and distribution are what it holds when it drafts that position on the
accepted path, and the label is whether its greedy draft equals the target's token: exactly the verdict greedy
verification gives. The data is kept in the cache folder (keyed by prompts, models and length), so training
again takes seconds. Training is full-batch AdamW on CPU over a small grid (weight decay; with or without the
hidden state), each keeping its epoch of best loss on two training prompts per group held out for validation;
the grid point with the best validation loss wins. The head's accuracy is then reported on
`benchmarks/prompts.json` (the benchmark's prompts, never trained or validated on), beside the drafter's top
probability alone (the confidence rule's signal) as a baseline. The file records the commit, seed, data and
figures it came from.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from sampling import autoregressive_run
from sampling.acceptance_head import (
    DEFAULT_HEAD,
    DISTRIBUTION_FEATURES,
    AcceptanceHead,
    drafter_identity,
    features,
    save_head,
)
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from utils.models.cache_folder import cache_root
from utils.models.draft_vocab import DEFAULT_DRAFT_VOCAB, ShortlistHead, start_shortlist, use_draft_vocab
from utils.models.model_loader import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
from utils.paths import expand_user
from benchmarks.cli import at_least, guarded, random_seed, read_prompts, tool_parser, writable_file

HERE = Path(__file__).parent


def parser():
    p = tool_parser("benchmarks.train_acceptance_head", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--prompts", default=str(HERE / "train_prompts.json"), help="training prompts, by group")
    p.add_argument("--held-out", default=str(HERE / "prompts.json"), help="prompts the accuracy is reported on")
    p.add_argument("--max-new-tokens", type=at_least(2), default=96,
                   help="target answer length per prompt (a label needs a token after the first)")
    p.add_argument("--validation-per-group", type=at_least(1), default=2, help="training prompts kept for early stopping")
    p.add_argument("--epochs", type=at_least(1), default=400)
    p.add_argument("--width", type=at_least(1), default=64, help="hidden units of the MLP")
    p.add_argument("--seed", type=random_seed, default=0)
    p.add_argument("--out", default=str(DEFAULT_HEAD),
                   help=f"where the head is saved (default: the shipped head the chat loads, "
                        f"{DEFAULT_HEAD.relative_to(HERE.parent)}: a run replaces it)")
    return p


def data_args(argv=None):
    """The data settings alone (prompts, models, answer length), for the tools that collect the same records
    (`acceptance_signals`, `draft_replay`): they write no head, so nothing is checked for one."""
    return parser().parse_args(argv)


def parse_args(argv=None):
    """The trainer's command line, checked before minutes of loading and collecting: both prompt files, the
    validation split, the head's file."""
    p = parser()
    args = p.parse_args(argv)
    read_prompts(p, args.held_out, "--held-out")
    fewest = min(len(prompts) for prompts in read_prompts(p, args.prompts).values())
    if args.validation_per_group >= fewest:
        p.error(f"--validation-per-group: every group of --prompts needs a prompt to train on beside the "
                f"{args.validation_per_group} kept for validation; its smallest group has {fewest}")
    args.out = str(writable_file(p, "--out", args.out))
    return args


class Collector:
    def __init__(self, args):
        # As the chat loads them: the drafter is the cheap copy it drafts with, its head over the shortlist.
        self.target, self.tokenizer = load_model(args.target)
        self.drafter, drafter_tokenizer = load_model(args.drafter, int8=True, int4_drafter=True)
        use_draft_vocab(self.drafter, drafter_tokenizer, DEFAULT_DRAFT_VOCAB)
        self.stop = stop_tokens(self.tokenizer, self.target, chat=True)
        self.n = args.max_new_tokens

    @torch.no_grad()
    def drafter_pass(self, seq: list[int]) -> tuple[Tensor, Tensor]:
        """The drafter reads `seq` once -> (logits [L, vocab] as each position drafted in the chat: a shortlist
        head's conversation ids from where the sequence first holds them, hidden [L, hidden]: its head's input)."""
        head = self.drafter.get_output_embeddings()
        start_shortlist(self.drafter, torch.tensor(seq))
        seen = {}
        hook = head.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0]))
        try:
            logits = self.drafter(input_ids=torch.tensor([seq])).logits[0].float()  # [L, vocab]
        finally:
            hook.remove()
        if isinstance(head, ShortlistHead):
            logits = logits.masked_fill(~head.listed_along(torch.tensor(seq)), float("-inf"))
        return logits, seen["hidden"][0]

    @torch.no_grad()
    def examples(self, prompt: str) -> tuple[Tensor, Tensor, Tensor]:
        """-> features [n, hidden + 3], labels [n] (1: the greedy draft equals the target's token), top
        probability [n], for the answer's positions after the first."""
        ids = chat_ids(self.tokenizer, prompt)
        answer = autoregressive_run(ids, self.target, self.n, None, self.stop, True).tokens
        logits, hidden = self.drafter_pass(ids + answer)
        first, last = len(ids), len(ids) + len(answer) - 1  # positions whose successor is answer[1:]
        hidden = hidden[first:last]  # [n, hidden]
        probs = torch.softmax(logits[first:last], dim=-1)  # [n, vocab]
        labels = (probs.argmax(-1) == torch.tensor(answer[1:])).float()  # [n]
        return features(hidden, probs), labels, probs.max(-1).values


def collect(args, prompts_file: str) -> dict[str, list[tuple]]:
    """The examples of every prompt of `prompts_file`, from the cache folder when collected before."""
    key = hashlib.sha1(json.dumps([expand_user(prompts_file).read_text(), args.target, args.drafter, args.max_new_tokens,
                                   inspect.getsource(features), inspect.getsource(Collector),
                                   DEFAULT_DRAFT_VOCAB]).encode()).hexdigest()[:16]
    path = cache_root() / "acceptance-data" / f"{key}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    if args.collector is None:
        args.collector = Collector(args)
    data = collect_examples(args.collector, read_prompts(None, prompts_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def collect_examples(collector: Collector, prompts: dict[str, list[str]]) -> dict[str, list[tuple]]:
    data = {}
    for group, texts in prompts.items():
        data[group] = []
        for text in texts:
            start = time.perf_counter()
            data[group].append(collector.examples(text))
            print(f"  {group}: {len(data[group][-1][1])} positions in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
    return data


def stack(parts: list[tuple]) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


GRID = [(decay, hidden) for hidden in (True, False) for decay in (0.01, 0.1, 1.0)]  # (weight decay, hidden state)


def train(x: Tensor, y: Tensor, vx: Tensor, vy: Tensor, width: int, epochs: int, seed: int, decay: float,
          use_hidden: bool) -> tuple:
    torch.manual_seed(seed)
    head = AcceptanceHead(x.shape[1] - DISTRIBUTION_FEATURES, width, use_hidden)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0).clamp_min(1e-4))
    optimiser = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=decay)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    best = (float("inf"), None, 0)
    for epoch in range(epochs):
        head.train()
        optimiser.zero_grad()
        loss_fn(head(x), y).backward()
        optimiser.step()
        head.eval()
        with torch.no_grad():
            val = loss_fn(head(vx), vy).item()
        if val < best[0]:
            best = (val, {k: v.clone() for k, v in head.state_dict().items()}, epoch + 1)
    head.load_state_dict(best[1])
    return head.eval(), best[0], best[2]


def auc(scores: Tensor, labels: Tensor) -> float:
    """The chance that an accepted draft scores above a rejected one (ties count half)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).float().mean()
    ties = (pos[:, None] == neg[None, :]).float().mean()
    return float(greater + 0.5 * ties)


def evaluate(head: AcceptanceHead, data: dict[str, list[tuple]]) -> dict:
    report = {}
    for group, parts in [*data.items(), ("all", [p for parts in data.values() for p in parts])]:
        x, y, top = stack(parts)
        with torch.no_grad():
            predicted = torch.sigmoid(head(x))
        report[group] = {"positions": len(y), "accepted": round(float(y.mean()), 4),
                         "accuracy": round(float(((predicted > 0.5).float() == y).float().mean()), 4),
                         "majority_accuracy": round(float(max(y.mean(), 1 - y.mean())), 4),
                         "auc": round(auc(predicted, y), 4), "top_probability_auc": round(auc(top, y), 4)}
    return report


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    args.collector = None
    print("training data", file=sys.stderr)
    data = collect(args, args.prompts)
    print("held-out data", file=sys.stderr)
    test = collect(args, args.held_out)
    k = args.validation_per_group
    x, y, _ = stack([p for parts in data.values() for p in parts[:-k]])
    vx, vy, _ = stack([p for parts in data.values() for p in parts[-k:]])
    if not len(y) or not len(vy):  # every answer of a split ended at its first token: nothing to learn from
        raise ValueError(f"no positions to {'train on' if not len(y) else 'validate on'}: the answers ended at their "
                         "first token; give a larger --max-new-tokens or other prompts")
    trials = {}
    for decay, use_hidden in GRID:
        trials[(decay, use_hidden)] = train(x, y, vx, vy, args.width, args.epochs, args.seed, decay, use_hidden)
        print(f"  weight decay {decay:g}, hidden state {'in' if use_hidden else 'out'}: validation loss "
              f"{trials[(decay, use_hidden)][1]:.4f}", file=sys.stderr)
    (decay, use_hidden), (head, val_loss, epoch) = min(trials.items(), key=lambda item: item[1][1])
    figures = evaluate(head, test)
    provenance = {"commit": commit(), "seed": args.seed, "target": args.target, "drafter": args.drafter,
                  "prompts": Path(args.prompts).name,
                  "prompts_sha1": hashlib.sha1(expand_user(args.prompts).read_bytes()).hexdigest()[:12],
                  "max_new_tokens": args.max_new_tokens, "train_positions": len(y), "validation_positions": len(vy),
                  "validation_loss": round(val_loss, 4), "epoch": epoch, "weight_decay": decay,
                  "hidden_state": use_hidden, "held_out": figures,
                  "minutes": round((time.perf_counter() - started) / 60, 1)}
    identity = drafter_identity(args.collector.drafter if args.collector else load_model(args.drafter, int8=True,
                                                                                          int4_drafter=True)[0])
    save_head(head, Path(args.out), identity, provenance)
    print(json.dumps(provenance, indent=1))
    print(f"saved {args.out} ({Path(args.out).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    guarded(main)
