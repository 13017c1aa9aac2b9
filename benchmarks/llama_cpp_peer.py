"""llama.cpp as a peer in `python -m benchmarks`: its plain decoding and its prompt-lookup decoding on the same
GGUF file, the same thread count, the same prompt tokens (our chat template's ids), greedy.

Optional: `pip install llama-cpp-python` compiles llama.cpp (about 10 minutes on 2 cores); the README says which
build flags ran here. Its tokens are not expected to equal ours (other kernels, other rounding), so the
benchmark reports their tokens/s but no "output = AR" for them.
"""

from __future__ import annotations

from pathlib import Path

import torch

METHODS = ("llama-plain", "llama-lookup")
LOOKUP_TOKENS = 10  # drafts per round, as hf-prompt-lookup's prompt_lookup_num_tokens


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaPeer:
    def __init__(self, gguf: Path, context: int = 4096):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = torch.get_num_threads()
        common = dict(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.models = {
            "llama-plain": Llama(**common),
            "llama-lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)),
        }

    def generate(self, method: str, ids: list[int], n: int, stop: list[int]) -> list[int]:
        """Greedy tokens after `ids`, at most `n`, ending at a stop token (kept, as our generators keep it)."""
        llm = self.models[method]
        llm.reset()  # no prefix reuse from the previous generation: every run pays its prompt, as ours do
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if token in stop or len(out) >= n:
                break
        return out
