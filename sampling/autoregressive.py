"""Plain decoding: one target forward per token, through the same loop as speculative decoding."""

from __future__ import annotations

from typing import Callable

import torch

from sampling.drafters import NoDrafter
from sampling.loop import MODEL_EOS, GenerationResult, LoopSettings, Round, check_loop_args, generate
from utils.arguments import flag
from utils.logits_processor import GreedyProcessor, LogitsProcessor
from utils.model_runner import ModelRunner, check_runner, token_ids
from utils.printing import debug_printer


def autoregressive_run(
    inputs: list[int],
    model: torch.nn.Module,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor | None = None,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    use_cache: bool = False,
    on_round: Callable[[Round], None] | None = None,
    runner: ModelRunner | None = None,
    encoder_decoder: bool = False,
) -> GenerationResult:
    """Autoregressive decoding with full statistics. A `runner` of `model` kept from an earlier call reuses its KV
    cache for the prefix it shares with `inputs` (a conversation's next turn). With `encoder_decoder`, `inputs` go
    to the encoder and the new tokens are the decoder's."""
    settings = LoopSettings(max_gen_len=max_gen_len, gamma=0, eos_tokens_id=eos_tokens_id)
    processor = logits_processor if logits_processor is not None else GreedyProcessor()
    check_loop_args(processor, settings)
    if encoder_decoder:
        if runner is not None:
            raise ValueError("a runner is kept for decoder-only models: an encoder-decoder encodes its inputs anew")
        runner = ModelRunner(model, use_cache=use_cache, encoder_input_ids=inputs)  # checks the encoder's ids
        return generate(runner, NoDrafter(), [decoder_start_token(model)], processor, settings, on_round)
    inputs = token_ids(inputs, model)
    runner = check_runner(runner, model, "model") if runner is not None else ModelRunner(model, use_cache=use_cache)
    return generate(runner, NoDrafter(), inputs, processor, settings, on_round)


def autoregressive_generate(
    inputs: list[int],
    model: torch.nn.Module,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor | None = None,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,  # kept for API compatibility: batch size 1 needs no padding
    use_cache: bool = False,
    debug: bool = False,
) -> list[int]:
    """Generates up to `max_gen_len` tokens after `inputs` and returns them (the prompt excluded). `debug` prints
    each token as it comes (ids: no tokenizer here)."""
    on_round = debug_printer(None) if flag("debug", debug) else None
    return autoregressive_run(inputs, model, max_gen_len, logits_processor, eos_tokens_id, use_cache, on_round).tokens


def autoregressive_generate_encoder_decoder(
    inputs: list[int],
    model: torch.nn.Module,
    max_gen_len: int = 40,
    logits_processor: LogitsProcessor | None = None,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,
    use_cache: bool = False,
    debug: bool = False,
) -> list[int]:
    """Encoder-decoder (T5/BART-style) variant: `inputs` go to the encoder; returns the decoder's new tokens."""
    on_round = debug_printer(None) if flag("debug", debug) else None
    return autoregressive_run(inputs, model, max_gen_len, logits_processor, eos_tokens_id, use_cache, on_round,
                              encoder_decoder=True).tokens


def decoder_start_token(model: torch.nn.Module) -> int:
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "bos_token_id", None)
    if start is None:
        raise ValueError("the model's config names no decoder_start_token_id")
    return int(start)
