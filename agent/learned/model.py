"""The two-tower retention model and its weights file.

Expert tower: the expert's activation signature (its last HISTORY_BITS steps as bits) is projected
to a 256-d embedding, concatenated with its features and run through a 3-layer MLP -> h_e [32].
System tower: an LSTM (128 hidden) over the recent monitoring series (read latency, memory
pressure) -> s [32], plus a learned bias so it is never zero. Retention score = <h_e, s>: high
means "will be used again soon, keep".

The embedding is computed from what the expert did, not looked up by its id: an id table would
tie the network to one expert count and to one model's numbering (expert 5 of OLMoE has nothing
to do with expert 5 of Qwen) and would memorise which experts were hot in the training prompts,
which is exactly what drifts. A signature embedding runs unchanged on any number of experts.

Weights file: one safetensors file; its metadata holds the config and how it was trained.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from agent import atomic_file
from agent.atomic_file import write_atomically
from agent.learned.features import FEATURES, HISTORY_BITS

WEIGHTS = ("the policy weights", "--out")   # what save writes, and the flag that names it
HEADER_ROOM = 64 << 10   # a weights file's safetensors header and metadata, at most
SYSTEM_INPUTS = 2  # read latency, memory pressure


@dataclass(frozen=True)
class NetConfig:
    n_features: int = len(FEATURES)
    signature_bits: int = HISTORY_BITS
    embed_dim: int = 256
    hidden: int = 64
    out_dim: int = 32
    lstm_hidden: int = 128
    system_inputs: int = SYSTEM_INPUTS


class ExpertTower(nn.Module):
    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        self.embed = nn.Linear(c.signature_bits, c.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(c.embed_dim + c.n_features, c.hidden), nn.ReLU(),
            nn.Linear(c.hidden, c.hidden), nn.ReLU(),
            nn.Linear(c.hidden, c.out_dim))

    def forward(self, signature: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        emb = torch.relu(self.embed(signature))                 # [N, 256]
        return self.mlp(torch.cat([emb, features], dim=-1))     # [N, out]


class SystemTower(nn.Module):
    def __init__(self, c: NetConfig) -> None:
        super().__init__()
        self.lstm = nn.LSTM(c.system_inputs, c.lstm_hidden, batch_first=True)
        self.proj = nn.Linear(c.lstm_hidden, c.out_dim)
        # full, not ones / n: arithmetic on the meta device (load builds the net there) imports torch's
        # python reference ops, a second or more that a live switch to this policy would wait for
        self.bias = nn.Parameter(torch.full((c.out_dim,), c.out_dim ** -0.5))

    def forward(self, series: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(series)                           # series [B, T, inputs]
        return self.bias + self.proj(h[-1])                     # [B, out]


class RetentionNet(nn.Module):
    def __init__(self, config: NetConfig = NetConfig()) -> None:
        super().__init__()
        self.config = config
        self.expert = ExpertTower(config)
        self.system = SystemTower(config)

    def forward(self, signature: torch.Tensor, features: torch.Tensor, series: torch.Tensor) -> torch.Tensor:
        """Scores [N] of N experts sharing one system state (series [1, T, inputs])."""
        return (self.expert(signature, features) * self.system(series)).sum(-1)


def save(net: RetentionNet, path: Path, training: dict) -> None:
    """Write weights atomically (agent.atomic_file): a reader never sees half a file, and a write that
    fails leaves nothing (a ValueError names the file)."""
    meta = {"config": json.dumps(asdict(net.config)), "training": json.dumps(training)}
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    write_atomically(Path(path), lambda tmp: save_file(state, str(tmp), metadata=meta), *WEIGHTS,
                     errors=(SafetensorError,), ours=is_weights)


def check_writable(path: Path, config: NetConfig = NetConfig()) -> None:
    """Fail now, with the reason, if `save` could not write `path` (before hours of training, not after),
    nor find room for the weights (their tensors and a header's worth more)."""
    size = sum(t.numel() * t.element_size() for t in RetentionNet(config).state_dict().values()) + HEADER_ROOM
    atomic_file.check_writable(Path(path), *WEIGHTS, size=size, ours=is_weights)


def is_weights(path: Path) -> bool:
    """Whether `path` is a weights file `save` wrote (its header alone is read)."""
    try:
        _config(path)
    except (SafetensorError, OSError, KeyError, TypeError, ValueError):
        return False
    return True


def _config(path: Path) -> NetConfig:
    with safe_open(str(path), "pt") as f:
        return NetConfig(**json.loads((f.metadata() or {})["config"]))


def load(path: Path) -> RetentionNet:
    """Load a weights file written by `save`; a missing or damaged file is a clear ValueError."""
    path = Path(path)
    hint = ("retrain it with `flashmoe-cli train-policy`, give a valid file (simulate --policy-model), "
            "or run another policy (--policy lru)")
    if not path.is_file():
        raise ValueError(f"FlashMoE policy weights {path} do not exist; {hint}")
    try:
        config = _config(path)
        if wrong := [f"{name} {got} (this version computes {want})" for name, got, want in _inputs(config)
                     if got != want]:
            raise ValueError(f"they were trained on other inputs: {', '.join(wrong)}")
        with torch.device("meta"):  # no memory for the shapes the metadata claims: the file's tensors are taken
            net = RetentionNet(config)
        weights = load_file(str(path))
        _check_shapes(net, weights)
        net.load_state_dict(weights, assign=True)
        if bad := sorted(name for name, t in weights.items() if not torch.isfinite(t).all()):
            raise ValueError(f"{', '.join(bad)} hold NaN or infinite values")  # it would score every block alike
    except (SafetensorError, OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"FlashMoE policy weights {path} are not a valid weights file ({e}); {hint}") from None
    return net.eval()


def _check_shapes(net: RetentionNet, weights: dict[str, torch.Tensor]) -> None:
    """One line for the first tensor the file lacks, has too many of, or holds in another shape than its
    config makes (load_state_dict lists every one, a line each)."""
    want = {name: list(t.shape) for name, t in net.state_dict().items()}
    for name in sorted(want.keys() | weights.keys()):
        if name not in weights:
            raise ValueError(f"it lacks the tensor {name}")
        if name not in want:
            raise ValueError(f"it holds a tensor {name} that the network has not")
        if list(weights[name].shape) != want[name]:
            raise ValueError(f"{name} is {list(weights[name].shape)} where its config makes it {want[name]}")


def _inputs(config: NetConfig) -> tuple[tuple[str, int, int], ...]:
    """What a network reads, as the weights say and as this code computes it: the scorer's compiled loop
    trusts them to agree (fewer features in the weights would read past the first layer's rows)."""
    return (("expert features", config.n_features, len(FEATURES)),
            ("signature bits", config.signature_bits, HISTORY_BITS),
            ("system inputs", config.system_inputs, SYSTEM_INPUTS))


def training_info(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("training", "{}"))
