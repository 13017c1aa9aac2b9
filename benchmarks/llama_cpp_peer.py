"""llama.cpp as a peer in `python -m benchmarks`: its plain decoding, its prompt-lookup decoding and its
speculative decoding with the same drafter file (`llama-sd`: a second `Llama` on the drafter's GGUF fed through
llama-cpp-python's `draft_model` hook, drafting greedily, `SD_DRAFTS` tokens a round as our default gamma), on
the same GGUF files, the same thread count, the same prompt tokens (our chat template's ids), greedy.

Optional: `pip install llama-cpp-python` compiles llama.cpp (about 10 minutes on 2 cores); the README says which
build flags ran here. Its tokens are not expected to equal ours (other kernels, other rounding), so the
benchmark holds llama-sd's and llama-lookup's tokens against llama-plain's instead of our AR's. Their drafts are
counted (`CountingDraft`: llama-cpp-python calls the draft model once a verification round), so that the table shows
that llama-sd drafts and what it keeps, as for ours.
"""

from __future__ import annotations

from pathlib import Path

import torch

METHODS = ("llama-plain", "llama-lookup", "llama-sd")
LOOKUP_TOKENS = 10  # drafts per round, as hf-prompt-lookup's prompt_lookup_num_tokens
# drafts per round for llama-sd by default (`--llama-sd-drafts`): fixed, through llama-cpp-python's `draft_model`
# hook (a Python loop around its C++ passes, not llama.cpp's `llama-speculative`); 3, the gamma our native chat
# drafted at before `--gamma auto`
SD_DRAFTS = 3


def unavailable() -> str | None:
    """None where llama-cpp-python imports, else why not in one line: not installed, or installed without what
    it imports (a `--no-deps` install lacks diskcache, and the methods were only called unknown)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        if getattr(error, "name", None) == "llama_cpp":
            return "llama-cpp-python is not installed (pip install llama-cpp-python)"
        return f"llama-cpp-python does not import ({error})"
    return None


def available() -> bool:
    return unavailable() is None


class CountingDraft:
    """A draft model's rounds and drafts since `start()`, counted as our loop counts them; everything else is the
    wrapped model's. llama-cpp-python's hook cannot see the token budget, so it drafts its full count to the last
    round, and our loop never drafts past the budget: a round's drafts count only up to the slots the budget leaves
    it besides its own token (`sampling.loop.draft_length`). `proposed` is what it really drafted."""

    def __init__(self, inner):
        self.inner = inner
        self.count_from(0, None)

    def start(self, prompt_length: int, budget: int | None, stop=()) -> None:
        """A generation begins: `count_from`, and the drafter forgets its context (llama-sd's pays its prompt too)."""
        self.count_from(prompt_length, budget, stop)
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def count_from(self, prompt_length: int, budget: int | None, stop=()) -> None:
        """Counts from zero for `budget` new tokens at most after a prompt of `prompt_length`, ending at `stop`."""
        self.prompt_length, self.budget, self.stop = prompt_length, budget, set(stop)
        self.rounds = self.drafted = self.proposed = 0
        self.last: tuple[int, list[int]] = (0, [])  # the last round's tokens before it, its counted drafts

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        generated = len(input_ids) - self.prompt_length  # the hook is called with every token so far
        room = len(out) if self.budget is None else max(self.budget - generated - 1, 0)
        counted = [int(token) for token in out[:room]]
        self.rounds += 1
        self.drafted += len(counted)
        self.proposed += len(out)
        self.last = (generated, counted)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def model_drafter(drafter_gguf: Path, common: dict, drafts: int):
    """A `LlamaDraftModel` whose drafts are a second model's greedy tokens (llama-cpp-python ships only prompt
    lookup); its KV cache keeps the longest common prefix between calls, so each round feeds only what is new,
    until `reset()` at a generation's start (else a repeat skipped the drafter's prefill that ours pays)."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class ModelDraft(LlamaDraftModel):
        def __init__(self):
            self.llm = Llama(**{**common, "model_path": str(drafter_gguf)})

        def __call__(self, input_ids, /, **kwargs):
            out = []
            for token in self.llm.generate(list(input_ids), top_k=1, temp=0.0):
                out.append(token)
                if len(out) >= drafts:
                    break
            return np.array(out, dtype=np.intc)

        def reset(self):
            self.llm.reset()

    return ModelDraft()


class LlamaPeer:
    def __init__(self, gguf: Path, drafter_gguf: Path | None = None, context: int = 4096, sd_drafts: int = SD_DRAFTS):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = torch.get_num_threads()
        self.threads, self.sd_drafts = threads, sd_drafts
        common = dict(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.models = {
            "llama-plain": Llama(**common),
            "llama-lookup": Llama(**common, draft_model=CountingDraft(
                LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS))),
        }
        if drafter_gguf is not None:
            self.models["llama-sd"] = Llama(**common, draft_model=CountingDraft(
                model_drafter(drafter_gguf, common, sd_drafts)))

    def describe(self) -> str:
        """What the llama.cpp figures came from, for the results' metadata."""
        import llama_cpp

        sd = f"; llama-sd: {self.sd_drafts} drafts a round by the draft_model hook" if "llama-sd" in self.models else ""
        return f"llama-cpp-python {llama_cpp.__version__}, {self.threads} threads{sd}"

    def generate(self, method: str, ids: list[int], n: int, stop: list[int], on_first=None) -> list[int]:
        """Greedy tokens after `ids`, at most `n`, ending at a stop token (kept, as our generators keep it);
        `on_first()` is called as the first token comes (the prompt read), for a rate that leaves the prompt out."""
        llm = self.models[method]
        llm.reset()  # no prefix reuse from the previous generation: every run pays its prompt, as ours do
        if isinstance(llm.draft_model, CountingDraft):  # the counts, and llama-sd's drafter: its own prompt too
            llm.draft_model.start(len(ids), n, stop)
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if on_first is not None and len(out) == 1:
                on_first()
            if token in stop or len(out) >= n:
                break
        return out

    def counts(self, method: str, tokens: list[int]):
        """The last generation of `method` as our loop counts it (a GenerationResult), or None for llama-plain: one
        target pass for the prompt and one a round, each round keeping its accepted drafts and one token of its own
        (so accepted = tokens - 1 - rounds), drafts within the budget (`CountingDraft`), and, in a round that
        reaches the answer's end token, only the drafts up to it (`sampling.loop`: drafts past the end are cut)."""
        draft = self.models[method].draft_model
        if not isinstance(draft, CountingDraft):
            return None
        from sampling.loop import GenerationResult

        drafted, accepted = draft.drafted, max(len(tokens) - 1 - draft.rounds, 0)
        if draft.rounds and tokens and tokens[-1] in draft.stop:
            before, counted = draft.last
            ending = tokens[before:]  # the last round's tokens
            drafted -= len(counted) - min(len(counted), len(ending))
            if ending == counted[: len(ending)]:  # greedy: the end token was a kept draft, not the round's own
                accepted += 1
        return GenerationResult(list(tokens), drafted=drafted, accepted=accepted, target_calls=draft.rounds + 1,
                                rounds=draft.rounds + 1)


if __name__ == "__main__":  # a part of `python -m benchmarks`; run alone, it says whether the peer can run here
    from benchmarks.cli import tool_parser

    tool_parser("benchmarks.llama_cpp_peer", __doc__ + "\nRun alone, it says whether the peer can run here.").parse_args()
    print(f"llama.cpp peer ({', '.join(METHODS)}) of python -m benchmarks: "
          + ("available" if available() else f"unavailable: {unavailable()}"))
