"""Speculative decoding with a drafter model (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

from typing import Callable

import torch

from sampling.autoregressive import decoder_start_token
from sampling.draft_stop import (DRAFT_STOP_MEMBERS, AdaptiveLength, DraftStop, DraftStopConfig, alias_config,
                                 make_draft_stop)
from sampling.drafters import ModelDrafter
from sampling.loop import (MODEL_EOS, GenerationResult, LoopSettings, Round, check_loop_args, drafting_gamma,
                           generate)
from sampling.translating_drafter import TranslatingDrafter, same_vocabulary
from utils.arguments import flag, tokenizer_like
from utils.logits_processor import GreedyProcessor, LogitsProcessor
from utils.model_runner import ModelRunner, check_runner, token_ids, window_for
from utils.printing import debug_printer


def speculative_run(
    inputs: list[int],
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    logits_processor: LogitsProcessor | None = None,
    settings: LoopSettings | None = None,
    use_cache: bool = False,
    on_round: Callable[[Round], None] | None = None,
    encoder_decoder: bool = False,
    adaptive_gamma: bool = False,
    confidence: float = 0.0,
    runners: tuple[ModelRunner, ModelRunner] | None = None,
    tokenizer=None,
    drafter_tokenizer=None,
    draft_stop: DraftStopConfig | DraftStop | None = None,
    drafter_window: int | None = None,
) -> GenerationResult:
    """The speculative loop with a model drafter, returning full statistics. `draft_stop` chooses how many of
    up to `settings.gamma` drafts each round proposes (`sampling/draft_stop.py`): a config, a rule's name (with
    its defaults), or a rule built by `make_draft_stop` and kept across calls (what it measured carries over);
    `adaptive_gamma` and `confidence` > 0 are its older spellings (rules adaptive and confidence, together:
    confidence on an adaptive length). `runners` (target's, drafter's) kept from an earlier call reuse their KV
    caches for the prefix they share with `inputs`. With a
    `drafter_tokenizer` whose vocabulary differs from the target's `tokenizer`, drafts are translated through text
    and verified by exact match (`sampling/translating_drafter.py`): lossless for greedy and sampled decoding.
    A `drafter_window` of N positions has the drafter read only 4 sinks and its N-4 latest positions (TriForce,
    MagicDec): a long prompt's drafter prefill shrinks to N, and the target still checks every draft. None: the
    product's default (`window_for`: 32 with the cache off, everything with it on), or given `runners`, theirs."""
    processor = logits_processor if logits_processor is not None else GreedyProcessor()
    settings = settings if settings is not None else LoopSettings()
    check_loop_args(processor, settings, drafts=True)
    if not encoder_decoder:  # an encoder's ids are checked by each model's runner
        inputs = token_ids(inputs, target)
    target_runner, drafter_runner = speculative_runners(target, drafter, runners, use_cache,
                                                        inputs if encoder_decoder else None, drafter_window)
    stop = draft_stop_config(checked_draft_stop(draft_stop), adaptive_gamma, confidence)
    model_drafter = drafter_for(target_runner, drafter_runner, processor, stop, tokenizer, drafter_tokenizer,
                                encoder_decoder)
    prefix = [decoder_start_token(target)] if encoder_decoder else list(inputs)
    if not encoder_decoder and isinstance(model_drafter, ModelDrafter):
        # as the drafter reads them (ids past its embedding); a translating drafter reuses against its own tokens
        drafter_runner.reuse(model_drafter.as_read(prefix))
    return generate(target_runner, model_drafter, prefix, processor, settings, on_round)


def speculative_runners(target: torch.nn.Module, drafter: torch.nn.Module, runners, use_cache: bool,
                        encoder_ids: list[int] | None, drafter_window: int | None) -> tuple[ModelRunner, ModelRunner]:
    """(target's runner, drafter's runner): `runners` checked against the models, else new ones; on one device."""
    if runners is not None and encoder_ids is not None:
        raise ValueError("runners are kept for decoder-only models: an encoder-decoder pair encodes its inputs anew")
    if runners is not None:
        if not (isinstance(runners, (tuple, list)) and len(runners) == 2):
            raise ValueError("runners must be a pair: (the target's runner, the drafter's runner)")
        target_runner = check_runner(runners[0], target, "target")
        drafter_runner = check_runner(runners[1], drafter, "drafter")
        if drafter_window is not None and drafter_runner.window != drafter_window:
            raise ValueError("the drafter's runner was built with another window: build it with window=drafter_window")
    else:
        target_runner = ModelRunner(target, use_cache=use_cache, encoder_input_ids=encoder_ids)
        drafter_runner = ModelRunner(drafter, use_cache=use_cache, encoder_input_ids=encoder_ids,
                                     window=window_for(drafter_window, use_cache, drafter))
    if drafter_runner.device != target_runner.device and not any(
            getattr(m, "hf_device_map", None) for m in (target, drafter)):  # accelerate's hooks move inputs
        raise ValueError(f"the drafter is on {drafter_runner.device} and the target on {target_runner.device}: put "
                         "both on one device (drafter.to(target.device))")
    return target_runner, drafter_runner


def checked_draft_stop(draft_stop) -> DraftStopConfig | DraftStop | None:
    """`draft_stop` as a config (a rule's name, as the command line spells it, gets its defaults) or a built rule."""
    if isinstance(draft_stop, str):
        draft_stop = DraftStopConfig(draft_stop)
    if draft_stop is not None and not isinstance(draft_stop, DraftStopConfig) and not all(
            hasattr(draft_stop, name) for name in DRAFT_STOP_MEMBERS):
        raise ValueError(f"draft_stop must be a DraftStopConfig, a rule from make_draft_stop or a rule's name, "
                         f"got {draft_stop!r}")
    return draft_stop


def drafter_for(target_runner: ModelRunner, drafter_runner: ModelRunner, processor: LogitsProcessor,
                stop: DraftStopConfig | DraftStop, tokenizer, drafter_tokenizer, encoder_decoder: bool):
    """The drafter of the loop: the model's own drafts, or, where its tokenizer's vocabulary differs from the
    target's, its drafts translated through text (`sampling/translating_drafter.py`). `stop`: a config, or a rule
    built by `make_draft_stop` and kept across calls."""
    tokenizer, drafter_tokenizer = tokenizer_like("tokenizer", tokenizer), tokenizer_like("drafter_tokenizer",
                                                                                           drafter_tokenizer)
    if drafter_tokenizer is not None and tokenizer is None:
        raise ValueError("a drafter_tokenizer needs the target's tokenizer too (tokenizer=...)")
    built = not isinstance(stop, DraftStopConfig)
    if drafter_tokenizer is not None and not same_vocabulary(tokenizer, drafter_tokenizer):
        if encoder_decoder or built or stop.rule not in ("fixed", "adaptive", "auto"):
            raise ValueError("a drafter with another tokenizer drafts for decoder-only targets, with a fixed or "
                             "adaptive draft length")
        # auto: adaptive, the one rule that reads no distribution (its drafts are text)
        schedule = AdaptiveLength() if stop.rule in ("adaptive", "auto") else None
        return TranslatingDrafter(drafter_runner, processor, tokenizer, drafter_tokenizer, target_runner.vocab_size,
                                  schedule)
    return ModelDrafter(drafter_runner, processor, target_runner.vocab_size,
                        stop if built else make_draft_stop(stop, drafter_runner.model, target_runner.use_cache,
                                                           processor.is_greedy))


def draft_stop_config(config: DraftStopConfig | DraftStop | None, adaptive: bool,
                      confidence: float) -> DraftStopConfig | DraftStop:
    """`config` (or a built rule), or the rule the older flags spell; both at once is ambiguous."""
    adaptive = flag("adaptive_gamma", adaptive)
    if config is not None:
        if adaptive or confidence:
            raise ValueError("give draft_stop or the older adaptive_gamma/confidence, not both")
        return config
    return alias_config(adaptive, confidence)


def speculative_generate(
    inputs: list[int],
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor | None = None,
    max_gen_len: int = 40,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,  # kept for API compatibility: batch size 1 needs no padding
    use_cache: bool = False,
    skip_sample_adjustment: bool = False,
    first_target: bool = True,
    debug: bool = False,
    encoder_decoder: bool = False,
    drafter_tokenizer=None,
    drafter_window: int | None = None,
) -> tuple[list[int], float]:
    """Returns the new tokens and the acceptance rate (accepted drafts / drafted tokens). With `encoder_decoder`,
    both models encode `inputs` and the new tokens are the decoder's. A `drafter_tokenizer` other than the
    target's `tokenizer` has the drafter draft in its own tokens, translated for the target (lossless). A
    `drafter_window` of N has the drafter read only 4 sinks and its N-4 latest positions (lossless; None: 32 with the
    cache off, all with it on)."""
    settings = LoopSettings(max_gen_len, drafting_gamma(gamma), eos_tokens_id, first_target, skip_sample_adjustment)
    on_round = debug_printer(tokenizer_like("tokenizer", tokenizer)) if flag("debug", debug) else None
    result = speculative_run(inputs, drafter, target, logits_processor, settings, use_cache, on_round,
                             encoder_decoder=encoder_decoder, tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer,
                             drafter_window=drafter_window)
    return result.tokens, result.acceptance_rate


def speculative_generate_encoder_decoder(
    inputs: list[int],
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor | None = None,
    max_gen_len: int = 40,
    eos_tokens_id: int | list[int] | str | None = MODEL_EOS,
    pad_token_id: int = 0,
    use_cache: bool = False,
    skip_sample_adjustment: bool = False,
    first_target: bool = True,
    debug: bool = False,
) -> tuple[list[int], float]:
    """Encoder-decoder (T5/BART-style) variant of `speculative_generate`: both models encode `inputs`."""
    return speculative_generate(inputs, drafter, target, tokenizer, gamma, logits_processor, max_gen_len, eos_tokens_id,
                                pad_token_id, use_cache, skip_sample_adjustment, first_target, debug, encoder_decoder=True)
