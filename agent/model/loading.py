"""A Transformer from an expert store: config.json and dense.safetensors loaded and checked against
each other and against the expert index; the routed experts come from a provider.

    model = load_model(store_dir, ExpertCache(store_dir, cap), prefetch=True)
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import read_tensors
from agent.experts.layout import CONFIG, DENSE, INDEX, Index, StoreError, file_crc32
from agent.experts.provider import ExpertProvider
from agent.model.config import ConfigError, MoEConfig
from agent.model.dense_int8 import DENSE_MODES, quantize_dense
from agent.model.model import Transformer
from agent.model.route_trace import RouteTrace

CONVERT_AGAIN = "re-run flashmoe-cli convert"


def load_model(store_dir: Path, provider: ExpertProvider, prefetch: bool = True,
               route_trace: Sequence[Path] = (), workers: int = 1, dense: str = "stored",
               int8_activations: bool = True) -> Transformer:
    """Load config.json and dense.safetensors of an expert store; routed experts come from provider.
    With route trace files, each token's experts follow them (agent/model/route_trace.py); `workers`:
    the threads a step computes on (agent/workers.py); `dense`: the dense linears as stored or
    "int8", quantized now, whose activations are quantized too above 8 tokens with `int8_activations`
    (agent/model/dense_int8.py)."""
    check_dense(dense)
    store_dir = Path(store_dir)
    config = MoEConfig.from_file(store_dir / CONFIG)
    index = Index.load(store_dir / INDEX)
    check_index(config, index)
    trace = RouteTrace.load(route_trace, config) if route_trace else None  # a bad trace fails before the weights load
    model = from_state(config, dense_state(config, store_dir / DENSE, index.dense_crc32), provider, prefetch, workers)
    if dense == "int8":
        quantize_dense(model, int8_activations)
    if trace is not None:
        model.follow(trace)
    return model


def from_state(config: MoEConfig, state: dict[str, Tensor], provider: ExpertProvider,
               prefetch: bool = True, workers: int = 1) -> Transformer:
    with torch.device("meta"):  # no allocation: the loaded tensors are assigned as they are
        model = Transformer(config, provider, prefetch, workers)
    check_state(model, state)
    model.load_state_dict(state, assign=True)
    return model.eval()


def check_dense(dense: str) -> None:
    if dense not in DENSE_MODES:
        raise ValueError(f"dense must be one of {DENSE_MODES}, got {dense!r}")


def check_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    own = {k: v.shape for k, v in model.state_dict().items()}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in own.items() if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        raise StoreError(f"dense weights do not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                         f"wrong shape {wrong[:5]}; re-run flashmoe-cli convert on the checkpoint this config "
                         "belongs to")


def check_index(config: MoEConfig, index: Index) -> None:
    """The expert store must hold one block per (MoE layer, expert) of the shape config.json implies."""
    want = (len(config.moe_layer_ids), config.n_experts, config.dim, config.expert_dim)
    got = (index.n_layers, index.n_experts, index.hidden, index.intermediate)
    if want != got:
        raise ConfigError(f"config.json implies (MoE layers, experts, hidden, expert intermediate) = {want} but "
                          f"experts.index.json has {got}; re-run flashmoe-cli convert")


def dense_state(config: MoEConfig, path: Path, crc: int | None) -> dict[str, Tensor]:
    """dense.safetensors (transformers' save_pretrained names) renamed to this module's parameter names,
    checked against the index's crc32 as it is read: the dense weights take part in every token, so a flipped
    bit would quietly change every answer (the experts' blocks are checked as they are read). They are read
    into the process, not mapped: mapped, their pages could be dropped under pressure and faulted back in
    mid-token, and would stay charged after --dense int8 replaced them; the memory rule counts them whole."""
    try:
        tensors, found = read_tensors(path, remedy=CONVERT_AGAIN)
    except FileNotFoundError:
        raise StoreError(f"{path} is missing; {CONVERT_AGAIN}") from None
    except OSError as exc:
        raise StoreError(f"{path} cannot be read: {exc.strerror}") from None
    except CheckpointError as exc:
        if crc is not None and file_crc32(path) != crc:
            raise damaged(path) from None     # what makes it unreadable is the damage the crc names
        raise StoreError(str(exc)) from None
    if crc is not None and found != crc:
        raise damaged(path)
    return hf_to_state(config, tensors)


def damaged(path: Path) -> StoreError:
    return StoreError(f"{path} is damaged: its crc32 differs from the one {INDEX} recorded when the store was "
                      f"written; {CONVERT_AGAIN}")


def hf_to_state(config: MoEConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename transformers' non-expert tensor names to ours: drop "model.", Mixtral's block_sparse_moe is mlp."""
    state = {k.removeprefix("model.").replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()}
    if config.tie_embeddings and "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state
