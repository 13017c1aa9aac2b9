"""Generators: autoregressive and speculative decoding with a drafter model (lossless: the target's tokens when
greedy, its distribution when sampled), and beam search.
Built on the `utils` core (runner, cache, processors); imports neither the chat nor model loading."""

from sampling.autoregressive import (
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    autoregressive_run,
)
from sampling.beam_search import beam_search_generate
from sampling.draft_stop import DRAFT_STOPS, DraftStopConfig, make_draft_stop
from sampling.loop import MODEL_EOS, GenerationResult, LoopSettings, Round, generate
from sampling.speculative import speculative_generate, speculative_generate_encoder_decoder, speculative_run

__all__ = [
    "autoregressive_generate",
    "autoregressive_generate_encoder_decoder",
    "autoregressive_run",
    "beam_search_generate",
    "DRAFT_STOPS",
    "DraftStopConfig",
    "make_draft_stop",
    "MODEL_EOS",
    "GenerationResult",
    "LoopSettings",
    "Round",
    "generate",
    "speculative_generate",
    "speculative_generate_encoder_decoder",
    "speculative_run",
]
