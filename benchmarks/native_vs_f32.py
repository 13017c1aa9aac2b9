"""`python -m benchmarks.native_vs_f32`: how far the native mode's logits are from the float32 reference.

Loads the target twice (native, and dequantized to float32), and on the benchmark's prompts (chat template as the
CLI applies it) reports the largest absolute logit difference over the prompt positions, whether the two agree on
each position's top token, and how many of the float32 model's greedy tokens the native model reproduces before
the first difference. Position 0 is reported apart: its logits are the largest and least useful of a prompt.
Where llama-cpp-python is installed, llama.cpp's prompt logits on the same GGUF file are held against the same
float32 reference, as the yardstick for what 8-bit activations cost. Writes `<out>/native-vs-f32.md`.
"""

from __future__ import annotations

import json

import torch

from benchmarks import llama_cpp_peer
from benchmarks.run import PROMPTS, machine
from sampling import autoregressive_run
from utils.model_runner import common_prefix_length
from utils.models.model_loader import DEFAULT_TARGET, ModelLoadError, gguf_file, load_model, precision_summary
from utils.chat.prompt_tokens import chat_ids, stop_tokens
from benchmarks.cli import at_least, guarded, tool_parser, writable_folder


def differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """[positions, vocab] logits against the reference: max |difference| at position 0 and after it, and the
    share of positions after 0 whose top token agrees."""
    d = (a - b).abs().amax(-1)  # [positions]
    agree = (a[1:].argmax(-1) == b[1:].argmax(-1)).float().mean()
    return float(d[0]), float(d[1:].max()), float(agree)


def llama_cpp_logits(spec: str):
    """A function from prompt ids to llama.cpp's logits at every prompt position, or None without llama.cpp or
    a GGUF file behind `spec`."""
    if not llama_cpp_peer.available():
        return None
    import numpy as np
    from llama_cpp import Llama

    try:
        gguf = gguf_file(spec)
    except ModelLoadError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)

    def logits(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # [positions, vocab]

    return logits


def main(argv=None) -> None:
    p = tool_parser("benchmarks.native_vs_f32", __doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts-per-group", type=at_least(1), default=4)
    p.add_argument("--new-tokens", type=at_least(1), default=64)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    out = writable_folder(p, "--out", args.out)  # before the run, not after it
    native, tokenizer = load_model(args.target, "cpu", "auto")
    reference, _ = load_model(args.target, "cpu", "float32", onednn=True)
    llama = llama_cpp_logits(args.target)
    stop = stop_tokens(tokenizer, native, chat=True)
    rows = []
    for group, prompts in json.loads(PROMPTS.read_text()).items():
        for i, prompt in enumerate(prompts[: args.prompts_per_group]):
            ids = chat_ids(tokenizer, prompt)
            with torch.no_grad():
                a = native(torch.tensor([ids])).logits[0].float()  # [positions, vocab]
                b = reference(torch.tensor([ids])).logits[0].float()
            theirs = llama(ids)[:, : b.shape[1]] if llama else None
            ours = autoregressive_run(ids, native, args.new_tokens, None, stop, True).tokens
            exact = autoregressive_run(ids, reference, args.new_tokens, None, stop, True).tokens
            rows.append((group, i, *differences(a, b), *(differences(theirs, b) if llama else ("–",) * 3),
                         common_prefix_length(ours, exact), len(exact)))
            print(rows[-1], flush=True)
    f = lambda v, spec: v if isinstance(v, str) else format(v, spec)  # noqa: E731
    lines = [f"Machine: {machine()}; {args.target}: {precision_summary(native)} vs float32 (dequantized); "
             f"llama.cpp: {'the same GGUF file' if llama else 'not installed'}.", "",
             "| group | prompt | max abs logit difference, position 0 / after | top-1 agreement after position 0 "
             "| llama.cpp: max difference, 0 / after | llama.cpp: top-1 agreement "
             "| greedy tokens equal before the first difference |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {g} | {i} | {d0:.2f} / {d:.2f} | {agree:.1%} | {f(l0, '.2f')} / {f(l, '.2f')} | {f(lagree, '.1%')} "
              f"| {same} of {n} |" for g, i, d0, d, agree, l0, l, lagree, same, n in rows]
    (out / "native-vs-f32.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    guarded(main)
