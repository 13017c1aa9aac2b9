"""oneDNN linear layers for float32 models on CPU.

Measured on this project's 2-core AVX2 machines (README): torch's default float32 matmul (MKL) costs about as
much per row as it streams weights for small row counts, so a pass over 2-9 tokens costs 2-3 one-token passes
and speculative verification barely pays. oneDNN's linear, which ships with torch (`torch.utils.mkldnn`),
costs 1.8x a one-token pass for 9 tokens and is ~30% faster for one token. The weights are the same numbers;
only the kernel changes.
"""

from __future__ import annotations

import torch
from torch.utils import mkldnn


def onednn_applicable(model: torch.nn.Module) -> bool:
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Swaps every `nn.Linear` of `model` for torch's oneDNN linear, in place; returns how many were swapped."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, mkldnn.MkldnnLinear(child, torch.float32))
                swapped += 1
    return swapped
