"""`python -m benchmarks.prefill`: how long the target takes to read a long prompt before its first token, ours
(cache on, one pass over the prompt) against llama.cpp's on the same GGUF file and threads (when
llama-cpp-python is installed). The prompt is real text the project ships (its own source files), cut to
`--tokens` tokens of the target's tokenizer; the median of `--repeats` runs after one untimed run each."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks import llama_cpp_peer
from utils.caching import new_cache
from utils.models import qkernels
from utils.models.kernel_choice import describe_cpu
from utils.models.model_loader import DEFAULT_TARGET, gguf_file, load_model
from benchmarks.cli import EVEN, at_least, guarded, in_turn, tool_parser

SOURCES = sorted((Path(__file__).resolve().parents[1] / "sampling").glob("*.py"))


@torch.no_grad()
def ours(model, ids: list[int]) -> float:
    start = time.perf_counter()
    model(input_ids=torch.tensor([ids]), past_key_values=new_cache(model), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def llama(llm, ids: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = tool_parser("benchmarks.prefill", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--tokens", type=at_least(1), default=512)
    p.add_argument("--repeats", type=at_least(1), default=4, help=EVEN)
    args = p.parse_args(argv)
    model, tokenizer = load_model(args.target, device="cpu")
    text = "\n".join(path.read_text() for path in SOURCES)
    ids = tokenizer(text)["input_ids"][: args.tokens]
    runners = {"ours": lambda: ours(model, ids)}
    if llama_cpp_peer.available():
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        llm = Llama(model_path=str(gguf_file(args.target)), n_ctx=args.tokens + 16, n_threads=threads,
                    n_threads_batch=threads, n_batch=args.tokens, verbose=False)
        runners["llama.cpp"] = lambda: llama(llm, ids)
    times = {name: [] for name in runners}
    for repeat in range(args.repeats + 1):  # interleaved, every other round reversed; the first round is untimed
        for name in in_turn(list(runners), repeat):
            seconds = runners[name]()
            if repeat:
                times[name].append(seconds)
    print(f"{describe_cpu()}; {qkernels.describe()}; prompt of {len(ids)} tokens")
    base = statistics.median(times["ours"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: {median:.2f} s ({len(ids) / median:.1f} tokens/s), {median / base:.2f}x ours")


if __name__ == "__main__":
    guarded(main)
