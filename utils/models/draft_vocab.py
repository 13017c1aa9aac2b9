"""A drafter's output layer over a shortlist of the vocabulary (`--draft-vocab N`).

The drafter's head is a large share of its step: for the embedded 0.5B, 152k rows of 896 values, 85 MB of Q4_1
blocks read per draft, ~4 of its ~18 ms on the Xeon of benchmarks/RESULTS.md. Most of those rows are tokens a
code assistant never writes. The head here computes the N most frequent tokens of a ranking shipped for the
drafter's tokenizer (`benchmarks/token_rank.py` builds it from text every Python install holds), plus every token
of the conversation so far (a prompt's identifiers and strings) and the other spellings of its words (" prime"
brings "_prime" and "Prime"), and gives the rest of the vocabulary -inf: the drafter never proposes them.

Lossless: the drafter's distribution is whatever it is, and the verification rules use it as such (greedy: the
target's argmax decides; sampling: min(1, p/q) on the drafted token and the residual max(p - q, 0) keep the
target's distribution for any q). Only acceptance can change: a token outside the shortlist ends its round.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import torch
from torch import Tensor

from utils.models.tokenizer_cache import derived

RANK_FOLDER = Path(__file__).with_name("token_ranks")
DEFAULT_DRAFT_VOCAB = 32768  # chosen by a measured sweep (benchmarks/RESULTS.md, issue 21 fourth pass); 0: full head


def vocabulary(tokenizer) -> list[str]:
    """The tokenizer's tokens in id order."""
    return [str(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]


def spellings_of(tokenizer) -> dict[int, list[int]]:
    """`word_spellings` of the tokenizer's vocabulary (the one `derived` keeps, not computed a second time)."""
    return word_spellings(derived(tokenizer, vocabulary))


def tokenizer_fingerprint(tokens: list[str]) -> str:
    """A vocabulary's tokens in id order, hashed: a ranking applies only to the vocabulary it was counted in."""
    return hashlib.sha1("\n".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def rank_file(fingerprint: str) -> Path:
    return RANK_FOLDER / f"{fingerprint}.pt"


def load_ranking(tokens: list[str]) -> Tensor | None:
    """Token ids, most frequent first, counted for this vocabulary; None where none ships for it."""
    path = rank_file(tokenizer_fingerprint(tokens))
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return saved["ids"].long()


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's tensors are (a GGUFLinear's blocks are buffers, an nn.Linear's weight a parameter)."""
    return next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device


class ShortlistHead(torch.nn.Module):
    """logits [.., vocab] of a linear head computed only at `ids` (and ids added by `include`); -inf elsewhere.

    `head` is a GGUFLinear (its block rows are gathered) or a plain `nn.Linear`."""

    def __init__(self, head: torch.nn.Module, ids: Tensor, vocab: int, spellings: dict[int, list[int]] | None = None):
        super().__init__()
        self.full, self.vocab = head, vocab
        self.spellings = spellings or {}  # id -> the ids of the same word spelt otherwise (see `word_spellings`)
        self.shipped = ids.sort().values.cpu()  # [n] ascending (a cheap scatter), for the host's bookkeeping
        # the same on the head's device: the draft-stop rules index the drafter's logits with them
        self.register_buffer("ids", self.shipped.to(device_of(head)), persistent=False)
        self.sub = self.rows_of(self.ids)
        self.listed: Tensor  # [vocab]: computed, in either set of rows
        self.extra_ids: Tensor  # added by `include`, in the order they came
        self.heard: Tensor  # [vocab]: tokens `include` has seen
        self.extra: torch.nn.Module | None  # the rows of `extra_ids`
        self.computed: Tensor | None  # `support`, kept until `include` adds ids or the head moves
        self.forget()

    @property
    def out_features(self) -> int:
        return self.vocab

    @property
    def weight(self) -> Tensor:  # code that reads a head's weight reads the full one
        return self.full.weight

    def rows_of(self, ids: Tensor) -> torch.nn.Module:
        from utils.models.native_linear import GGUFLinear

        full = self.full
        if isinstance(full, GGUFLinear):
            return full.rows(ids)
        linear = torch.nn.Linear(full.weight.shape[1], ids.numel(), bias=getattr(full, "bias", None) is not None,
                                 device=full.weight.device, dtype=full.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(full.weight[ids])
            if linear.bias is not None:
                linear.bias.copy_(full.bias[ids])
        return linear

    def forget(self) -> None:
        """Back to the shipped shortlist, the conversation's ids gone: each generation starts here, so that what
        it drafts (and, sampled, which random draws it uses) follows its own sequence and seed alone, not the
        prompts answered before it."""
        self.listed = torch.zeros(self.vocab, dtype=torch.bool)
        self.listed[self.shipped] = True
        self.extra_ids = torch.empty(0, dtype=torch.long)
        self.heard = torch.zeros(self.vocab, dtype=torch.bool)
        self.extra, self.computed = None, None

    def include(self, ids: Tensor) -> None:
        """Adds these token ids, and the other spellings of their words, to the shortlist (the conversation's own
        tokens); a no-op for listed ones. They go into a second, small set of rows, so adding a few never copies
        the large one again."""
        ids = ids.reshape(-1).cpu().long()
        heard = ids[(ids >= 0) & (ids < self.vocab)]
        heard = heard[~self.heard[heard]].unique()  # listed or not: a listed word's other spellings may not be
        self.heard[heard] = True
        new = torch.tensor(sorted({j for i in heard.tolist() for j in self.spellings.get(i, [i])}), dtype=torch.long)
        new = new[~self.listed[new]]
        if new.numel():
            self.listed[new] = True
            self.extra_ids = torch.cat([self.extra_ids, new])
            self.extra = self.rows_of(self.extra_ids)
            self.computed = None

    def listed_along(self, ids: Tensor) -> Tensor:
        """[L, vocab] bool: the ids computed at each position of a sequence `ids` [L] that a generation reads from
        its start, as `include` hears it token by token; for one pass over a whole answer that drafts nothing
        (the acceptance head's data), whose logits must be what each position's draft saw."""
        ids = ids.reshape(-1).cpu().long()
        first = torch.full((self.vocab,), ids.numel(), dtype=torch.long)  # position from which an id is listed
        first[self.shipped] = 0
        for position, token in enumerate(ids.tolist()):
            if 0 <= token < self.vocab:
                spelt = torch.tensor(self.spellings.get(token, [token]), dtype=torch.long)
                first[spelt] = first[spelt].clamp_max(position)
        return first[None, :] <= torch.arange(ids.numel())[:, None]

    @property
    def support(self) -> Tensor:
        """[n]: every id whose logit is computed, on the head's device (what the draft-stop rules read)."""
        if self.computed is None or self.computed.device != self.ids.device:
            self.computed = torch.cat([self.ids, self.extra_ids.to(self.ids.device)])
        return self.computed

    def forward(self, x: Tensor) -> Tensor:
        y = self.sub(x)  # [.., n]
        out = y.new_full((*y.shape[:-1], self.vocab), float("-inf"))  # [.., vocab]
        out.index_copy_(-1, self.ids.to(y.device), y)
        if self.extra is not None:
            out.index_copy_(-1, self.extra_ids.to(y.device), self.extra(x))
        return out

    def extra_repr(self) -> str:
        return f"{self.ids.numel()} + {self.extra_ids.numel()} of {self.vocab} tokens"


def word_spellings(tokens: list[str]) -> dict[int, list[int]]:
    """id -> every id of the same word with another leading space, underscore or dot, or another case: a prompt
    saying " prime" makes the drafter able to write "is_prime" and "Prime" (byte-level BPE writes a space as
    "\u0120"). Words of three letters or more; shorter ones are in every shortlist anyway."""
    groups: dict[str, list[int]] = {}
    for i, token in enumerate(tokens):
        word = token.lstrip("\u0120\u2581_.").lower()
        if len(word) >= 3 and word.isalpha():
            groups.setdefault(word, []).append(i)
    return {i: ids for ids in groups.values() if len(ids) > 1 for i in ids}


def use_draft_vocab(model: torch.nn.Module, tokenizer, size: int) -> str:
    """Gives `model` a shortlist head of the `size` most frequent tokens (0, or the whole vocabulary: its full
    head back); returns a few words for the start-up line ("" for the full head), saying why not where it cannot."""
    from utils.models.native_linear import GGUFLinear

    head = model.get_output_embeddings()
    if isinstance(head, ShortlistHead):
        head = head.full
    # The model's head changes only once the new one is built: an error or Ctrl-C on the way (a damaged ranking,
    # a second of Python) leaves the head it had, which the caller's setting still describes.
    chosen, note = head, ""
    if size > 0:
        # rows are gathered from GGUF blocks or a plain weight; packed layouts (oneDNN, int4) are left whole
        if not (isinstance(head, GGUFLinear) or type(head) is torch.nn.Linear):
            note = "full head (no shortlist for this head's kernel)"
        elif size < (head.blocks if isinstance(head, GGUFLinear) else head.weight).shape[0]:
            built = shortlist_of(head, tokenizer, size)
            if isinstance(built, str):
                note = built
            else:
                chosen, note = built, f"head over {built.ids.numel()} of {built.vocab} tokens + the conversation's"
    model.set_output_embeddings(chosen)
    return note


def shortlist_of(head: torch.nn.Module, tokenizer, size: int) -> ShortlistHead | str:
    """A shortlist head over `head`'s `size` most frequent tokens, or why not ("full head (...)")."""
    from utils.models.native_linear import GGUFLinear

    weight = head.blocks if isinstance(head, GGUFLinear) else head.weight
    # both read back from a prepared folder's facts where there are (~1 s of Python a start on the Zen 3)
    tokens = derived(tokenizer, vocabulary)
    ranking = load_ranking(tokens)
    if ranking is None:
        return "full head (no token ranking for this tokenizer)"
    vocab = int(weight.shape[0])
    ids = ranking[ranking < vocab][:size]
    special = torch.tensor(sorted(i for i in tokenizer.all_special_ids if 0 <= i < vocab), dtype=torch.long)
    listed = torch.cat([ids, special]).unique()
    if isinstance(head, GGUFLinear) and head.interleaved:
        # the interleaved kernel takes whole groups of 8 rows: the next-ranked tokens fill the last group
        more = ranking[ranking < vocab][size:]
        listed = torch.cat([listed, more[~torch.isin(more, listed)][: -listed.numel() % 8]]).unique()
    return ShortlistHead(head, listed, vocab, derived(tokenizer, spellings_of))


def shortlisted(model: torch.nn.Module) -> bool:
    """Whether `model`'s head computes a shortlist (`use_draft_vocab` may have kept the full one: a size past the
    vocabulary, a head it cannot cut, no ranking)."""
    return isinstance(model.get_output_embeddings(), ShortlistHead)


def start_shortlist(model: torch.nn.Module, ids: Tensor | None = None) -> None:
    """A shortlist head (if `model` has one) forgets earlier generations' ids and hears `ids`: call at the start
    of each generation the model drafts or answers in."""
    head = model.get_output_embeddings()
    if isinstance(head, ShortlistHead):
        head.forget()
        if ids is not None:
            head.include(ids)
