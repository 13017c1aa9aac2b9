"""Our decoding loop against transformers' `generate()` on one device with the same model object: what the loop
costs per token where a pass is cheap (a GPU), with the cache on, greedy, in turns.

The models are random Qwen2 models shaped as the embedded target (no weights are read or downloaded): their tokens
mean nothing, their pass costs are those of the real shapes. Both loops must give the same tokens.

    python -m benchmarks.cuda_loop                  # cuda where torch sees one, else cpu
    python -m benchmarks.cuda_loop --shape tiny     # a seconds-long check of the script itself
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sampling import autoregressive_run
from utils.model_runner import synchronize
from utils.models.kernel_choice import describe_cpu, samples_in_turns
from benchmarks.cli import EVEN, at_least, guarded, tool_parser

SHAPES = {  # Qwen2.5-Coder-1.5B's shape (the embedded target), and a tiny one
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def random_model(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=4096, **SHAPES[shape])
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def synchronized(device: torch.device, run, outputs: dict, name: str):
    """A call of `run` for `samples_in_turns` that keeps its tokens and returns only once the device is done, so
    that its clock spans the device's work (the call before it ended synchronized too)."""
    def call() -> None:
        outputs[name] = run()
        synchronize(device)
    return call


def main() -> None:
    parser = tool_parser("benchmarks.cuda_loop", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default="1.5b")
    parser.add_argument("--tokens", type=at_least(1), default=128)
    parser.add_argument("--repeats", type=at_least(1), default=4, help=EVEN)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(args.shape, args.device, dtype)
    prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    n = args.tokens

    @torch.no_grad()
    def transformers_loop() -> list[int]:
        ids = torch.tensor([prompt], device=args.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def our_loop() -> list[int]:
        return autoregressive_run(prompt, model, max_gen_len=n, eos_tokens_id=-1, use_cache=True).tokens

    loops = {"transformers generate()": transformers_loop, "ours (autoregressive_run)": our_loop}
    outputs = {}
    # in turns after untimed ones (kernels, allocator), every other turn reversed, so a drifting clock or a busy
    # neighbour hits both alike
    seconds = samples_in_turns({name: synchronized(model.device, run, outputs, name) for name, run in loops.items()},
                               args.repeats)
    device = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if args.device.startswith("cuda")
              else describe_cpu())  # the CPU's line names torch
    print(f"{args.shape} random Qwen2, {dtype}, {args.device} ({device}), "
          f"{len(prompt)}-token prompt, {n} new tokens, greedy, cache on, best of {args.repeats}")
    base = min(seconds["transformers generate()"])
    for name, ts in seconds.items():
        best = min(ts)
        print(f"  {name:26s} {n / best:8.1f} tokens/s  {best / n * 1e3:7.2f} ms/token  {base / best:5.2f}x generate()")
    same = outputs["ours (autoregressive_run)"] == outputs["transformers generate()"]
    print(f"  same tokens: {same}")
    if not same:
        raise SystemExit("the two loops gave different tokens")


if __name__ == "__main__":
    guarded(main)
