"""Runs one model over a growing token sequence, feeding only what its cache does not hold yet.

Every generator talks to models through `ModelRunner.logits(seq, k)`: "the logits that predict the last `k`
positions' successors". With the cache on, the runner first rolls the cache back to what it may keep (through
`prune_cache`, the one function that cuts a cache), then feeds only the new tokens at the right positions; with it
off, it feeds the whole sequence. Decoder-only and encoder-decoder models share this interface.

A prompt's pass (the first after `reuse`; with the cache on, any long one) can be fed in chunks of
`prefill_chunk` positions, each reported to `progress`; cache off, the chunks go through a cache of the pass's
own, dropped after it. The runner's count of cached positions follows every chunk, so Ctrl-C between two
chunks leaves a cache that is exact for what it holds. Where the model is batch invariant
(native GGUF mode: row-wise attention, our integer kernels) a chunked prefill gives the same logits as one pass
(tested); elsewhere it changes the prompt's logits in the last bits, the same way for every generator.

A runner with a `window` of N positions (the drafter of `--drafter-window`, TriForce/MagicDec's StreamingLLM
drafter) feeds and keeps only 4 attention sinks and the N-4 most recent positions, with their true position ids:
a prompt of 4k tokens costs it a prefill of N. Only a drafter may be windowed: its drafts are checked by a target
that reads everything, so the output stays the target's. What a pass's first query reads: cache off, exactly the
sinks and its N-4 latest positions; cache on, the same, but after a rollback of r drafts (past what it holds, it
refills) up to r-1 recent positions fewer until new ones fill the window again. Holding more for the rollbacks to
find would have every pass read more than N (the model attends to all it holds); refilling would cost a pass of N.
"""

from __future__ import annotations

import inspect
import operator
from typing import Callable, Protocol

import torch
from torch import Tensor

from utils import h2o, snapkv
from utils.arguments import count, flag
from utils.caching import (CACHE_POLICIES, SINKS, BoundedCache, SlidingRollbackError, cache_length, cache_refusal,
                           kv_policy, layer_lengths, new_cache, prune_cache, trim_sliding)

# Cache off, a later pass over more positions than LONG_PASS (a long prompt's answer) is read in LONG_PASS_CHUNK
# pieces through a cache of its own where the model is batch invariant (native GGUF mode: the same bits, tested):
# Ctrl-C lands between pieces instead of after a pass of seconds, and the pieces are faster (the 1.5B, Zen 5:
# 600 positions 2.33 -> 2.04 s, 1500 positions 8.0 -> 6.3 s; twenty-ninth pass, benchmarks/RESULTS.md). Below it
# pieces cost more than they save (320 positions: +0-5%), so the default chat's passes stay whole.
LONG_PASS, LONG_PASS_CHUNK = 512, 256


class Progress(Protocol):  # what `progress(total)` returns: tqdm's interface
    def update(self, n: int) -> object: ...

    def close(self) -> object: ...


def context_limit(model: torch.nn.Module) -> int | None:
    """Longest sequence the model can attend over, or None when positions are unbounded (relative ones)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "relative_attention_num_buckets", None):
        return None
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, use_cache: bool = False, encoder_input_ids: list[int] | None = None,
                 prefill_chunk: int = 0, progress: Callable[[int], Progress] | None = None, window: int = 0):
        check_eval(model)
        if encoder_input_ids is not None and not model.config.is_encoder_decoder:
            raise ValueError(f"{type(model).__name__} is no encoder-decoder model: give its prompt to the "
                             "decoder-only generators (autoregressive_generate, speculative_generate)")
        use_cache = flag("use_cache", use_cache)
        if model.device.type == "meta":
            raise ValueError(f"{type(model).__name__} has no weights (its parameters are on the meta device): load "
                             "them before generating")
        self.model = model
        self.window = check_window(window, model)  # positions fed and kept: sinks + recent ones (0: all)
        refusal = cache_refusal(model)  # a recurrent state cannot be rolled back, nor read in chunks
        if refusal and use_cache:
            raise ValueError(f"{refusal}; run it with the cache off")
        self.prefill_chunk = 0 if refusal else prefill_chunk  # positions per prefill pass (0: one pass)
        self.progress = progress  # progress(total positions) -> a bar, for chunked prefills
        self.use_cache = use_cache
        self.device = model.device
        self.cache = self.new_cache() if use_cache else None
        self.policy = kv_policy(model) if not self.window else "streaming"  # a window streams whatever the model's
        self.compresses = self.policy in CACHE_POLICIES  # the cache is cut to the budget after each prompt pass
        if self.compresses and not use_cache:
            raise ValueError(f"the {self.policy} policy evicts from the KV cache: turn the cache on")
        self.new_prompt = True  # the next pass reads a prompt (the first after `reuse`)
        self.rollback_reserve = 0  # entries a bounded cache keeps past its window: a drafter's drafts of a round
        self.cached = 0  # positions of the current sequence held by the cache
        self.fed: Tensor | None = None  # the sequence whose first `cached` positions the cache holds
        self.calls = 0  # forward passes, for statistics
        self.limit = context_limit(model)
        self.keeps_logits = keeps_logits(model)
        self.encoder_outputs = None
        if model.config.is_encoder_decoder:
            if encoder_input_ids is None:
                raise ValueError("an encoder-decoder model needs encoder input ids")
            encoder_input_ids = token_ids(encoder_input_ids, model)
            check_prompt_fits(len(encoder_input_ids), self.limit)
            ids = torch.tensor([encoder_input_ids], dtype=torch.long, device=self.device)
            self.encoder_outputs = model.get_encoder()(input_ids=ids)

    @property
    def vocab_size(self) -> int:
        return output_size(self.model)

    def logits(self, seq: Tensor, k: int) -> Tensor:
        """`seq`: [1, L] -> logits [1, k, vocab] predicting positions L-k+1 .. L."""
        length = seq.shape[1]
        start = self.roll_back(length - k) if self.use_cache else 0
        positions = self.to_feed(start, length, k)  # [n]: what this call feeds, the last k included
        prompt, self.new_prompt = self.new_prompt, False
        if prompt and self.compresses:
            logits = self.prompt_pass(seq, positions, k)
        elif not prompt and self.long_pass(positions.numel()):
            logits = self.chunked_pass(seq, positions, k, LONG_PASS_CHUNK)
        else:
            logits = self.feed(seq, positions, k, chunked=prompt or self.use_cache, bar=prompt)
        if self.use_cache:
            self.fed, self.cached = seq, length  # `fed` first: a count never outruns its sequence
        return logits

    def feed(self, seq: Tensor, positions: Tensor, k: int, chunked: bool = True, bar: bool = False) -> Tensor:
        """Logits [1, k, vocab] for the last `k` of `positions`; with `chunked`, what precedes them in chunks (with
        `bar`, a prompt's: under a progress bar)."""
        if chunked and self.prefill_chunk and positions.numel() - k > self.prefill_chunk:
            if not self.use_cache:
                return self.chunked_pass(seq, positions, k, bar=bar)
            self.prefill(seq, positions[:-k], bar=bar)
            positions = positions[-k:]
        out = self.forward(seq[:, positions], k, positions)
        self.calls += 1
        return out.logits[:, -k:, :]

    def long_pass(self, width: int) -> bool:
        """Whether a cache-off pass of `width` positions is read in LONG_PASS_CHUNK pieces (LONG_PASS): only where
        the runner reads in chunks at all and the model is batch invariant."""
        return (not self.use_cache and bool(self.prefill_chunk) and width > LONG_PASS
                and getattr(self.model, "batch_invariant", False))

    def chunked_pass(self, seq: Tensor, positions: Tensor, k: int, chunk: int = 0, bar: bool = False) -> Tensor:
        """Cache off, a long pass in chunks (`chunk`, else `prefill_chunk`) through a cache of its own, dropped
        after: Ctrl-C between chunks (and for a prompt's pass, progress), and where the model is batch invariant,
        the logits of one pass."""
        self.cache = self.new_cache()
        try:
            self.prefill(seq, positions[:-k], chunk, bar)
            out = self.forward(seq[:, positions[-k:]], k, positions[-k:])
            self.calls += 1
            return out.logits[:, -k:, :]
        finally:
            self.cache, self.cached, self.fed = None, 0, None

    def prompt_pass(self, seq: Tensor, positions: Tensor, k: int) -> Tensor:
        """SnapKV and H2O: the prompt read with full attention, its queries observed (SnapKV's last ones, all for
        H2O), then the cache compressed to the budget (`utils/snapkv.py`, `utils/h2o.py`); drafts fed with the
        prompt follow in a pass of their own, after the compression, as they would in any later pass."""
        prompt = positions.numel() - k + 1  # positions up to the prompt's last one
        self.cache.settle()  # what is held is final: the prompt attends to exactly what is kept
        held = cache_length(self.cache)
        first = held if self.policy == "h2o" else max(held, held + prompt - snapkv.OBSERVATION)
        try:
            with snapkv.observing(first, held + prompt) as observation:
                logits = self.feed(seq, positions[:prompt], 1, bar=True)  # [1, 1, vocab]
        except BaseException:  # Ctrl-C between chunks: an uncompressed cache would break the budget's rule
            self.cache, self.cached, self.fed, self.new_prompt = self.new_cache(), 0, None, True
            raise
        self.cache.compress(observation, protect=self.cache.window - 1)
        if k == 1:
            return logits
        return torch.cat([logits, self.feed(seq, positions[prompt:], k - 1)], dim=1)  # [1, k, vocab]

    def roll_back(self, start: int) -> int:
        """Cuts the cache back to at most `start` positions; returns the first position to feed."""
        if self.cached > start:
            # Entries past `start` belong to rejected drafts or must be recomputed: drop them.
            if self.window and self.cached - start > self.cache.recent_length():
                self.start_over()  # past what a window keeps: it refills cheaply
            elif isinstance(self.cache, h2o.H2OCache) and not self.cache.can_remove(self.cached - start):
                # Past H2O's final evictions (a drafter's rollback longer than its reserve): read it all again.
                self.start_over()
                self.new_prompt = True
            else:
                try:
                    self.cache = prune_cache(self.cache, self.cached - start)
                    self.cached = start
                except SlidingRollbackError:  # past what a sliding window still holds: read it all again, exact
                    self.start_over()
        elif not isinstance(self.cache, BoundedCache):
            trim_sliding(self.cache)  # nothing to roll back: what a sliding layer recorded is no longer needed
        self.evict()
        return self.cached

    def recover(self) -> bool:
        """After a pass cut short (Ctrl-C): the cache cut back to the positions counted, which are exact (a count
        follows each pass that landed), so the next turn still reuses them. False where that cannot be trusted: a
        bounded or compressing cache, an encoder-decoder's (its cross-attention part fills on the first pass), or one
        that cannot roll back so far; the caller then starts over."""
        if (not self.use_cache or self.compresses or isinstance(self.cache, BoundedCache)
                or self.encoder_outputs is not None or len(set(layer_lengths(self.cache))) > 1):
            return False  # unequal layers: Ctrl-C landed between two of them, whose entries are not all counted
        try:
            self.cache = prune_cache(self.cache, cache_length(self.cache) - self.cached)
        except ValueError:  # more counted than held, or a sliding window past what it can restore
            return False
        return True

    def evict(self) -> None:
        """Between passes, so a rollback never needs what a bounded cache forgets. A window keeps no drafts past
        itself, so a pass never reads more than its N positions (fewer after a rollback: the module's docstring)."""
        if isinstance(self.cache, BoundedCache):
            self.cache.evict(0 if self.window else self.rollback_reserve)

    def to_feed(self, start: int, length: int, k: int) -> Tensor:
        """The positions to feed so that the last `k` are predicted: all from `start`, or in a window, the sinks
        and the recent positions the first of the `k` queries sees (the skipped ones are never computed; a
        cache first forgets what it holds before them)."""
        if not self.window:
            return torch.arange(start, length, device=self.device)
        recent = self.window - SINKS
        first_recent = max(SINKS, length - k - recent + 1)
        if self.use_cache:
            self.cache.keep_recent(start - first_recent)  # what it holds before the window is not seen again
        sinks = range(start, min(SINKS, length))
        return torch.tensor([*sinks, *range(max(start, first_recent), length)], device=self.device)

    def prefill(self, seq: Tensor, positions: Tensor, size: int = 0, bar: bool = False) -> None:
        """Feeds `positions` of `seq` into the cache in chunks (of `size`, else `prefill_chunk`), counting each as
        it lands; a progress bar only for a prompt's chunks (`bar`): mid-answer it would cover the text."""
        meter = self.progress(positions.numel()) if self.progress is not None and bar else None
        try:
            for chunk in positions.split(size or self.prefill_chunk):
                if snapkv.ACTIVE is None:  # SnapKV evicts after the whole prompt
                    self.evict()
                self.forward(seq[:, chunk], 1, chunk)
                self.calls += 1
                self.fed, self.cached = seq, int(chunk[-1]) + 1
                if meter is not None:
                    meter.update(chunk.numel())
        finally:
            if meter is not None:
                meter.close()

    def start_over(self) -> None:
        """A fresh cache: the next pass reads the sequence again (exact, only slower)."""
        self.cache, self.cached = self.new_cache(), 0

    def new_cache(self):
        return BoundedCache(SINKS, self.window - SINKS) if self.window else new_cache(self.model)

    def reuse(self, ids: list[int]) -> int:
        """Prepares the cache for a new sequence `ids` (the next turn of a conversation): keeps the entries of the
        longest common prefix of `ids` and what the cache holds, drops the rest. Token ids are compared, never
        assumed: a chat template re-renders the history, and a reply re-tokenised may split differently.
        Returns the number of positions kept."""
        self.new_prompt = True
        if not self.use_cache or self.fed is None or self.cached == 0:
            return 0
        if self.compresses:
            # SnapKV and H2O choose what to keep from the attention of a prompt's queries. A kept cache chose for
            # the earlier turns on their own (and H2O scored their answers one query at a time), and whether a
            # runner can cut back to the shared prefix depends on how its passes fell: generators kept apart would
            # see different caches and answer differently. So every turn is read afresh, as a whole prompt.
            self.start_over()
            return 0
        held = self.fed[0, : self.cached].tolist()
        common = common_prefix_length(held, ids)
        try:
            if not self.holds_its_count():
                raise ValueError("a pass cut short left entries that no count knows")
            if not self.keeps_window(common):
                raise ValueError("the bounded cache forgot what the next query must see")
            self.cache = prune_cache(self.cache, self.cached - common)
            self.cached = common
        except ValueError:  # a sliding window that cannot roll back that far: start over, still exact
            self.start_over()
        return self.cached

    def holds_its_count(self) -> bool:
        """Whether every layer holds the positions counted. A pass that failed after some layers wrote (Ctrl-C
        between two, an error in the head after all of them) leaves entries no count knows, and a kept runner would
        read them as its next positions. A bounded cache holds fewer by design: not judged here."""
        return isinstance(self.cache, BoundedCache) or set(layer_lengths(self.cache)) <= {self.cached}

    def keeps_window(self, common: int) -> bool:
        """Whether a bounded cache cut back to `common` positions still holds the window the next query sees."""
        if not isinstance(self.cache, BoundedCache) or isinstance(self.cache, h2o.H2OCache):
            return True  # H2O's crop refuses a rollback into final evictions
        forgotten = self.cached - cache_length(self.cache)
        first_recent = self.cache.sinks + forgotten  # the position of the oldest entry after the sinks
        return forgotten == 0 or common - first_recent >= self.cache.window - 1

    def forward(self, new_ids: Tensor, k: int, positions: Tensor):
        """`new_ids`: [1, n] at `positions` [n] -> the model's output for its last `k` positions."""
        extra = {"logits_to_keep": k} if self.keeps_logits else {}
        if self.window or isinstance(self.cache, BoundedCache):
            # The model would count positions from what the cache holds, which eviction has shortened.
            extra["position_ids"] = positions.unsqueeze(0)
            if self.cache is None:
                # Without a cache or a mask, transformers reads position ids that jump (a window's sinks, then its
                # recent positions: 0 1 2 3 16 17 ...) as packed sequences and keeps the recent ones from the sinks.
                extra["attention_mask"] = torch.ones_like(new_ids)
        if self.encoder_outputs is not None:
            return self.model(
                encoder_outputs=self.encoder_outputs,
                decoder_input_ids=new_ids,
                past_key_values=self.cache,
                use_cache=self.cache is not None,
            )
        with h2o.attending(self.cache):
            return self.model(input_ids=new_ids, past_key_values=self.cache, use_cache=self.cache is not None,
                              **extra)


# The drafter's window where none is set ("auto") and the cache is off. Cache off, every drafter pass feeds its
# whole window again, so the window bounds each draft's cost. The default chat's speculative decoding (1.5B and
# 0.5B, gamma 6, 35 tokens, the 12 held-out prompts, in turns): 16-21% less time per group at 32 positions than
# with the whole sequence, acceptance 87/74/68% against 91/90/66% (16: 76/67/51%; 24, 48, 64 slower than 32;
# twenty-fourth pass, benchmarks/RESULTS.md). With the cache on a draft's pass is one row wide whatever the window,
# and "auto" reads everything.
CACHE_OFF_WINDOW = 32


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether `model` computes its vocabulary projection only for the last positions asked (`logits_to_keep`):
    it saves a whole prefill's worth of it."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def synchronize(device: torch.device) -> None:
    """Waits for `device`'s queued work: a timer read after it counts the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def window_for(window: int | None, use_cache: bool, model: torch.nn.Module | None = None) -> int:
    """The drafter window a setting stands for: `window` as it is, or for None ("auto") `CACHE_OFF_WINDOW` with the
    cache off (0 where `model` cannot take it: an encoder-decoder, a shorter context) and 0 with it on."""
    if window is not None:
        return window
    if use_cache:
        return 0
    try:
        return check_window(CACHE_OFF_WINDOW, model)
    except ValueError:
        return 0


def check_runner(runner: "ModelRunner", model: torch.nn.Module, role: str) -> "ModelRunner":
    """`runner`, which must run `model`: a runner kept for another model would answer in that model's place."""
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"the {role}'s runner must be a ModelRunner({role}, ...), got {type(runner).__name__}")
    if runner.model is not model:
        raise ValueError(f"the {role}'s runner runs another model: build it as ModelRunner({role}, ...)")
    return runner


def check_eval(model: torch.nn.Module) -> None:
    """A model in training mode has its dropout on: every pass would draw other logits, and no two generators
    (nor two runs) would agree."""
    if model.training:
        raise ValueError(f"{type(model).__name__} is in training mode (dropout on, so answers would differ run to "
                         "run): call model.eval() first")


def check_window(window: int, model: torch.nn.Module | None = None) -> int:
    """A drafter window: 0 (off), or at least twice the sinks and within the model's context (without a model,
    the first check alone: a command line is refused before the models load)."""
    window = count("drafter_window", window or 0)
    if not window:
        return 0
    if window < 2 * SINKS:
        raise ValueError(f"a drafter window must be at least {2 * SINKS} positions ({SINKS} sinks and "
                         f"at least as many recent ones), got {window}")
    if model is None:
        return window
    limit = context_limit(model)
    if limit is not None and window > limit:
        raise ValueError(f"a drafter window of {window} positions is larger than the drafter's context of {limit}")
    if model.config.is_encoder_decoder:
        raise ValueError("a drafter window needs a decoder-only drafter")
    return window


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens two id sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def output_size(model: torch.nn.Module) -> int:
    """Rows of the output projection (the vocabulary, padded), whether it is nn.Linear or our oneDNN linear."""
    head = model.get_output_embeddings()
    return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]


def input_size(model: torch.nn.Module) -> int:
    """Rows of the token embedding: the ids the model can read."""
    return model.get_input_embeddings().num_embeddings


def token_ids(inputs, model: torch.nn.Module, what: str = "inputs") -> list[int]:
    """`inputs` (a list, tuple, 1-D integer tensor or array of ids) as a list of ids `model` can read. Anything
    else is a ValueError that says what is wrong, where the embedding would raise IndexError for an id past its
    rows (or a negative one) and torch a RuntimeError for a nested list."""
    if isinstance(inputs, (str, bytes)):
        raise ValueError(f"{what} must be token ids, got text; tokenize it first")
    if isinstance(inputs, torch.Tensor) and (inputs.dim() != 1 or inputs.is_floating_point()):
        raise ValueError(f"{what} must be a 1-D integer tensor (one sequence), got {inputs.dtype} of shape "
                         f"{tuple(inputs.shape)}")
    try:
        items = inputs.tolist() if isinstance(inputs, torch.Tensor) else list(inputs)
        if any(isinstance(t, bool) for t in items):
            raise TypeError
        ids = [operator.index(t) for t in items]
    except TypeError:
        raise ValueError(f"{what} must be a flat list of token ids (one sequence, no batch), got "
                         f"{str(inputs)[:60]}") from None
    size = input_size(model)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} in {what} is outside the model's vocabulary (ids 0 to {size - 1})")
    return ids


def check_prompt_fits(prompt_len: int, limit: int | None) -> None:
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if limit is not None and prompt_len > limit:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context of {limit}")
