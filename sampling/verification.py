"""Verify-and-accept: the step that keeps speculative decoding lossless.

Names follow Leviathan et al. (2023), Algorithm 1: `p` are the target's probabilities, `q` the drafter's,
`r` the uniform draws and `n` the number of accepted drafts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from utils.logits_processor import LogitsProcessor


def accept_by_rejection(p: Tensor, q: Tensor, drafts: Tensor, processor: LogitsProcessor, adjust: bool = True) -> Tensor:
    """Rejection sampling against a drafter distribution.

    p: [1, g+1, vocab], q: [1, g, vocab], drafts: [1, g].
    Returns [g+2] on the device: `n` first, then the drafts with the next token written at position n.
    Draft i is kept with probability min(1, p_i(x) / q_i(x)); after the first rejection the next token comes
    from the residual max(0, p - q) normalised (or from p when that residual is all zero, or when every draft
    was kept: q_{g} is taken as zero, so the residual is p itself).
    """
    g = drafts.shape[1]
    p_x = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [1, g]
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [1, g]
    r = torch.rand(p_x.shape, device=p.device, dtype=p.dtype)  # [1, g]
    accepted = r * q_x < p_x  # r < p/q without dividing by q
    n = ((~accepted).cumsum(-1) < 1).sum()  # first rejection, as a 0-d tensor: no host sync
    p_n = p[0].index_select(0, n.view(1))[0]  # [vocab]
    if adjust:
        q_padded = torch.cat([q[0], q.new_zeros((1, q.shape[-1]))], dim=0)  # [g+1, vocab]
        residual = (p_n - q_padded.index_select(0, n.view(1))[0]).clamp_min(0)  # [vocab]
        total = residual.sum()
        p_n = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p_n)
    token = processor.sample(p_n)  # []
    return pack(n, drafts, token)


def accept_by_sampling(p: Tensor, drafts: Tensor, processor: LogitsProcessor) -> Tensor:
    """Verification for a deterministic drafter (n-grams), and for greedy decoding, where a drafter's q is one-hot
    and `accept_by_rejection` reduces to this: sample y_i from each p_i, keep draft i while y_i equals it, and the
    first y that differs (or the bonus sample) is the next token. Each emitted token is an exact draw from the
    target's distribution, which re-sampling from p after a rejection would not be.

    p: [1, g+1, vocab], drafts: [1, g]. Returns [g+2] as `accept_by_rejection` does.
    """
    g = drafts.shape[1]
    y = processor.sample(p[0])  # [g+1]
    accepted = (y[:g] == drafts[0]).unsqueeze(0)  # [1, g]
    n = ((~accepted).cumsum(-1) < 1).sum()
    token = y.index_select(0, n.view(1))[0]
    return pack(n, drafts, token)


def pack(n: Tensor, drafts: Tensor, token: Tensor) -> Tensor:
    out = torch.cat([drafts[0], drafts.new_zeros(1)])  # [g+1]
    out = out.index_put((n.view(1),), token.view(1).to(out.dtype))
    return torch.cat([n.view(1).to(out.dtype), out])  # [g+2]


def unpack(packed: Tensor) -> tuple[int, list[int]]:
    """One host sync per round: returns n and the n+1 tokens this round emits."""
    values = packed.tolist()  # n and the tokens in one transfer: the verification's only sync
    n = values[0]
    return n, values[1 : n + 2]
