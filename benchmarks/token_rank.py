"""`python -m benchmarks.token_rank`: ranks a tokenizer's tokens by how often they occur in code and English, for
the drafter's shortlist head (`--draft-vocab N`, utils/models/draft_vocab.py).

Text: every Python install's standard library (its .py sources: code, comments, docstrings; pydoc's topics:
English prose) and the project's training prompts (benchmarks/train_prompts.json), never the benchmark's
evaluation prompts. The counts rank the tokens seen; unseen tokens follow in id order (BPE merge order, a
frequency order of the tokenizer's own corpus). Saved as utils/models/token_ranks/<tokenizer fingerprint>.pt with
the commit, Python version and token counts it came from. `--check` reports the coverage of a held-out part of
that text and of the benchmark prompts at several shortlist sizes instead of saving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from utils.models.draft_vocab import rank_file, tokenizer_fingerprint, vocabulary
from utils.models.model_loader import DEFAULT_DRAFTER, load_model
from benchmarks.cli import guarded, tool_parser

ROOT = Path(__file__).resolve().parent.parent
MAX_CHARS = 20_000  # per file: long files would outweigh the rest
KEPT = 65536  # ranks saved: larger shortlists than this cost nearly the full head anyway


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def texts(files: list[Path]) -> list[str]:
    return [f.read_text(errors="ignore")[:MAX_CHARS] for f in files]


def prompt_texts(name: str) -> list[str]:
    groups = json.loads((ROOT / "benchmarks" / name).read_text())
    return [p for prompts in groups.values() for p in prompts]


def count(tokenizer, parts: list[str], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for start in range(0, len(parts), 64):
        for ids in tokenizer(parts[start:start + 64], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def ranking(counts: torch.Tensor) -> torch.Tensor:
    # most frequent first; ties (the unseen tokens above all) in id order
    return torch.sort(-counts, stable=True).indices


def coverage(rank: torch.Tensor, counts: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    total = int(counts.sum())
    return {n: float(counts[rank[:n]].sum()) / max(total, 1) for n in sizes}


def main() -> None:
    parser = tool_parser("benchmarks.token_rank", __doc__)
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, help="whose tokenizer (embedded name, id or path)")
    parser.add_argument("--check", action="store_true", help="coverage of held-out text at several sizes; no save")
    args = parser.parse_args()
    _, tokenizer = load_model(args.drafter, progress=False)
    vocab = len(tokenizer)
    files = corpus_files()
    if args.check:
        train, held = files[::2], files[1::2]  # every other file held out
        rank = ranking(count(tokenizer, texts(train) + prompt_texts("train_prompts.json"), vocab))
        sizes = [8192, 16384, 24576, 32768, 49152, 65536]
        for name, counts in (("held-out stdlib", count(tokenizer, texts(held), vocab)),
                             ("benchmark prompts", count(tokenizer, prompt_texts("prompts.json"), vocab))):
            figures = ", ".join(f"{n}: {c:.2%}" for n, c in coverage(rank, counts, sizes).items())
            print(f"{name} ({int(counts.sum())} tokens) covered by the top N: {figures}")
        return
    import pydoc_data.topics  # English prose: the reference's topics as pydoc shows them

    parts = texts(files) + list(pydoc_data.topics.topics.values()) + prompt_texts("train_prompts.json")
    counts = count(tokenizer, parts, vocab)
    rank = ranking(counts)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    path = rank_file(tokenizer_fingerprint(vocabulary(tokenizer)))
    path.parent.mkdir(parents=True, exist_ok=True)
    provenance = {"commit": commit, "python": sys.version.split()[0], "files": len(files), "texts": len(parts),
                  "tokens": int(counts.sum()), "seen": int((counts > 0).sum()), "tokenizer": args.drafter}
    torch.save({"ids": rank[:KEPT].to(torch.int32).clone(), "provenance": provenance}, path)
    print(f"saved {path.relative_to(ROOT)}: {json.dumps(provenance)}")


if __name__ == "__main__":
    guarded(main)
