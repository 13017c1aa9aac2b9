"""SpecDec++'s acceptance head: a small MLP that predicts, from the drafter's last hidden state and four
features of its distribution, whether the target will accept the draft just made.

Trained by `python -m benchmarks.train_acceptance_head` for one drafter; the file records which one (its shapes
and a fingerprint of its final norm's weights), the commit, seed and data it came from, and loading refuses a
head made for another drafter.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from sampling.draft_stop import entropy
from utils.paths import expand_user, short_path

DEFAULT_HEAD = Path(__file__).with_name("heads") / "qwen2.5-coder-0.5b-instruct.pt"
DISTRIBUTION_FEATURES = 4  # top probability, second probability, entropy in nats, log of the top probability


class AcceptanceHead(nn.Module):
    def __init__(self, hidden_size: int, width: int = 64, use_hidden: bool = True):
        super().__init__()
        size = hidden_size + DISTRIBUTION_FEATURES
        self.register_buffer("mean", torch.zeros(size))  # feature standardisation, fitted with the weights
        self.register_buffer("std", torch.ones(size))
        # 0 where a feature is left out: the hidden state, when the distribution's features alone validate better
        self.register_buffer("mask", torch.ones(size))
        if not use_hidden:
            self.mask[:hidden_size] = 0
        self.mlp = nn.Sequential(nn.Linear(size, width), nn.SiLU(), nn.Linear(width, 1))

    def forward(self, features: Tensor) -> Tensor:
        """features: [n, hidden + 4] -> logits of acceptance [n]."""
        return self.mlp((features - self.mean) / self.std * self.mask).squeeze(-1)

    @torch.no_grad()
    def predict(self, hidden: Tensor, probs: Tensor) -> float:
        """hidden: [1, hidden]; probs: [1, vocab] -> the predicted chance that the draft is accepted."""
        x = features(hidden.to(self.mean.device), probs.to(self.mean.device))
        return torch.sigmoid(self(x)).item()  # the one host sync per draft of the learned rule


def features(hidden: Tensor, probs: Tensor) -> Tensor:
    """hidden: [n, hidden], probs: [n, vocab] (softmax at temperature 1) -> [n, hidden + 4]."""
    top2 = probs.float().topk(2, dim=-1).values  # [n, 2]
    return torch.cat([hidden.float(), top2, entropy(probs), top2[:, :1].clamp_min(1e-30).log()], dim=-1)


def final_norm(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", None)
    return getattr(inner, "norm", None)


def drafter_identity(model: nn.Module) -> dict:
    """What a head must match: the drafter's shapes and a fingerprint of its final norm (a few decimals, so the
    same weights loaded as float32, bfloat16-born or native GGUF agree)."""
    config = model.config
    norm = final_norm(model)
    fingerprint = None
    if norm is not None and getattr(norm, "weight", None) is not None:
        values = norm.weight.detach().float().cpu().numpy().round(3)
        fingerprint = hashlib.sha1(values.tobytes()).hexdigest()[:16]
    return {"hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
            "vocab_size": int(config.vocab_size), "norm_fingerprint": fingerprint}


def save_head(head: AcceptanceHead, path: Path, identity: dict, provenance: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": head.state_dict(), "width": head.mlp[0].out_features, "drafter": identity,
                "provenance": provenance}, path)


def load_head(path: str | Path | None, drafter: nn.Module | None) -> AcceptanceHead:
    """The head at `path` (None: the shipped one), checked against `drafter`; ValueError in one line otherwise."""
    try:
        path = expand_user(str(path)) if path is not None else DEFAULT_HEAD
    except ValueError as error:
        raise ValueError(f"no acceptance head at {short_path(path)}: {error}") from None
    try:
        with warnings.catch_warnings():  # a foreign file's (pickle protocol, indexing) would come before our line
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True)
            identity, state = saved["drafter"], saved["state"]
            head = AcceptanceHead(identity["hidden_size"], saved["width"])
            head.load_state_dict(state)
    except FileNotFoundError:
        raise ValueError(f"no acceptance head at {short_path(path)}") from None
    except OSError as error:  # a folder, no permission, a name longer than the system takes
        raise ValueError(f"cannot read {short_path(path)}: {error.strerror or type(error).__name__}") from None
    except Exception as error:  # a truncated or foreign file: torch raises many kinds
        raise ValueError(f"{short_path(path)} is not an acceptance head ({type(error).__name__})") from None
    if drafter is not None:
        mine = drafter_identity(drafter)
        differ = [k for k, v in identity.items() if v is not None and mine.get(k) is not None and mine[k] != v]
        if differ:
            raise ValueError(f"the acceptance head {path.name} was trained for another drafter ({differ[0]} "
                             f"{identity[differ[0]]} here {mine[differ[0]]}); train one for this drafter with "
                             "python -m benchmarks.train_acceptance_head --drafter …")
    head.provenance = saved.get("provenance", {})
    return head.eval()
