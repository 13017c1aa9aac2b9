"""Whether a drafter can draft for a target token for token: the same ids for the same strings."""

from __future__ import annotations

import re

from utils.models.load_error import ModelLoadError
from utils.model_runner import input_size, output_size

# llama.cpp's converter fills a GGUF vocabulary out to the embedding's rows with these; no text encodes to them
PADDING = re.compile(r"\[PAD\d+\]")


def check_vocab_compatible(target, target_tokenizer, drafter, drafter_tokenizer) -> None:
    """Refuses a drafter that cannot read every id the target's tokenizer has (a larger target vocabulary: the
    drafter would index past its embedding), or whose ids mean other strings than the target's over the ids both
    models share (one model's vocabulary may be padded larger)."""
    target_vocab = target_tokenizer.get_vocab()
    readable = min(input_size(drafter), output_size(drafter))
    # a padded head's placeholder entries (Qwen2.5-7B's file lists 152,064 against the 0.5B's 151,936) are no ids
    # text gives; the target may still sample one, which the drafter reads as another (`ModelDrafter.readable`)
    beyond = sorted(i for t, i in target_vocab.items() if i >= readable and not PADDING.fullmatch(t))
    if beyond:
        raise ModelLoadError(
            f"the target's vocabulary is larger than the drafter's: {len(beyond)} target ids are at or past the "
            f"drafter's {readable} (first: id {beyond[0]}); choose a drafter of the target's family"
        )
    backend = getattr(target_tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(drafter_tokenizer, "backend_tokenizer", None) is backend:
        return  # one tokenizer backend (tokenizer_cache shares it between folders of the same files): one vocabulary
    drafter_vocab = drafter_tokenizer.get_vocab()
    if drafter_vocab == target_vocab:  # one family's tokenizer: nothing to compare id by id
        return
    shared = min(output_size(target), output_size(drafter))
    target_ids = {i: t for t, i in target_vocab.items() if i < shared}
    drafter_ids = {i: t for t, i in drafter_vocab.items() if i < shared}
    differing = [i for i in set(target_ids) | set(drafter_ids) if target_ids.get(i) != drafter_ids.get(i)]
    if differing:
        first = min(differing)
        raise ModelLoadError(
            f"the drafter's vocabulary does not match the target's: {len(differing)} of {shared} shared ids differ "
            f"(id {first}: {target_ids.get(first)!r} vs {drafter_ids.get(first)!r})"
        )
