"""A Hugging Face MoE checkpoint as convert reads it, checked before anything is written.

ARCHS says how each architecture names its routed experts; the tensors come from one
model.safetensors or the shards of model.safetensors.index.json; plan() checks config.json against
the safetensors headers (layers, expert counts, shapes, dtypes) and returns the Plan: the byte
ranges of every expert block and the dense tensors under the names save_pretrained gives them.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath

from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import DTYPES, Span, TensorInfo, read_header
from agent.convert.store_writer import StoreShape
from agent.experts.layout import CONFIG
from agent.model.config import ConfigError, MoEConfig
from agent.tokenizer import TOKENIZER_JSON, HFTokenizer, TokenizerError

SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Arch:
    """How one architecture names its routed experts (shapes come from agent.model.config.MoEConfig)."""
    moe_modules: tuple[str, ...]         # names the MoE block has inside a decoder layer; [0] is the saved one
    projections: tuple[str, str, str]    # per-expert gate, up, down module names


_QWEN = ("gate_proj", "up_proj", "down_proj")
ARCHS = {"olmoe": Arch(("mlp",), _QWEN), "qwen3_moe": Arch(("mlp",), _QWEN), "qwen2_moe": Arch(("mlp",), _QWEN),
         "mixtral": Arch(("block_sparse_moe", "mlp"), ("w1", "w3", "w2")), "deepseek_v2": Arch(("mlp",), _QWEN)}


@dataclass
class LayerTensors:
    per_expert: dict[tuple[int, int], TensorInfo]   # (expert, 0 gate | 1 up | 2 down) -> tensor
    fused: dict[str, TensorInfo]                    # "gate_up_proj" | "down_proj" -> tensor
    module: str                                     # the MoE module name this layer uses


@dataclass
class Plan:
    """Everything convert will write, checked against config.json; nothing has been written yet."""
    shape: StoreShape
    blocks: list[tuple[Span, Span, Span]]     # gate, up, down of each block, layer-major
    dense: list[tuple[str, TensorInfo]]       # output name, source tensor
    files: list[Path]                         # config.json and tokenizer.json if present


def plan(src: Path) -> Plan:
    """Read config.json and the safetensors headers of `src` and check that they agree."""
    src = Path(src)
    config = _read_config(src)
    arch = ARCHS[config.arch]
    moe_ids = config.moe_layer_ids  # store layer i holds decoder layer moe_ids[i]'s experts
    shape = StoreShape(len(moe_ids), config.n_experts, config.dim, config.expert_dim, dtype="", itemsize=0)
    layers, dense = _split(_read_tensors(src), arch, config, src)
    dtypes = set()
    blocks: list[tuple[Span, Span, Span]] = []
    for layer in moe_ids:
        spans, layer_dtypes = _layer_spans(layer, layers.pop(layer, None), arch, shape)
        blocks += spans
        dtypes |= layer_dtypes
    if layers:
        raise CheckpointError(f"{src}: layer(s) {sorted(layers)} have expert tensors but config.json makes them "
                              f"dense MLP layers (mlp_only_layers / decoder_sparse_step / first_k_dense_replace); "
                              f"the config disagrees with the checkpoint")
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise CheckpointError(f"{src}: expert tensors have dtype(s) {sorted(dtypes)}; flashmoe needs one of "
                              f"{', '.join(DTYPES)} for all experts (quantized checkpoints are not supported)")
    _check_dense_shapes(dict(dense), config, arch)
    torch_dtype, itemsize = DTYPES[dtypes.pop()]
    shape = StoreShape(shape.n_layers, shape.n_experts, shape.hidden, shape.intermediate, torch_dtype, itemsize)
    return Plan(shape, blocks, [(_saved_name(n, arch), t) for n, t in dense], [src / CONFIG] + _tokenizer(src))


def _tokenizer(src: Path) -> list[Path]:
    """tokenizer.json, if there is one, loaded as generate will load it: a broken one is refused now, not copied
    into a store that then fails to generate."""
    path = src / TOKENIZER_JSON
    if not path.exists():
        return []
    try:
        HFTokenizer(path)
    except TokenizerError as exc:
        raise CheckpointError(str(exc)) from None
    return [path]


def _read_config(src: Path) -> MoEConfig:
    path = src / CONFIG
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass the checkpoint directory that holds config.json")
    if not path.is_file():  # MoEConfig's own message is about a store's --model
        raise CheckpointError(f"{path} not found; SRC_DIR must be a Hugging Face checkpoint with its config.json")
    try:
        return MoEConfig.from_file(path)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _read_tensors(src: Path) -> dict[str, TensorInfo]:
    files, weight_map = _checkpoint_files(src)
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].span.file.name} and {file.name}")
            tensors[name] = info
    for name, fname in weight_map.items():
        if name not in tensors or tensors[name].span.file.name != fname:
            raise CheckpointError(f"{src / SHARD_INDEX} puts {name} in {fname}, but that shard lacks it; "
                                  f"re-download the shard")
    return tensors


def _outside(shard: str) -> bool:
    """Whether a shard index entry leads out of the checkpoint directory, judged by its text alone: a shard
    that is a symlink into the Hugging Face cache's blobs/ is inside."""
    path = PurePath(os.path.normpath(shard))
    return path.is_absolute() or path.parts[:1] == ("..",)


def _checkpoint_files(src: Path) -> tuple[list[Path], dict[str, str]]:
    if (src / SHARD_INDEX).exists():
        try:
            weight_map = json.loads((src / SHARD_INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{src / SHARD_INDEX} is not a valid shard index: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{src / SHARD_INDEX} is not a valid shard index: its weight_map must map each "
                                  f"tensor name to the name of the shard file that holds it; re-download it")
        outside = [f for f in sorted(set(weight_map.values())) if _outside(f)]
        if outside:
            raise CheckpointError(f"{src / SHARD_INDEX} names {outside[0]!r} as a shard, a path outside the "
                                  f"checkpoint directory {src}: an index names the shard files beside it; "
                                  f"re-download it")
        files = [src / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"missing shard(s) {', '.join(missing)} listed in {src / SHARD_INDEX}; "
                                  f"download them into {src}")
        return files, weight_map
    if (src / "model.safetensors").exists():
        return [src / "model.safetensors"], {}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} has no model.safetensors, shard index or *.safetensors file")
    return files, {}


def _split(tensors: dict[str, TensorInfo], arch: Arch, config: MoEConfig,
           src: Path) -> tuple[dict[int, LayerTensors], list[tuple[str, TensorInfo]]]:
    """Sort tensors into each layer's routed experts and everything else (dense)."""
    modules = "|".join(map(re.escape, arch.moe_modules))
    projs = "|".join(map(re.escape, arch.projections))
    per_expert = re.compile(rf"model\.layers\.(\d+)\.({modules})\.experts\.(\d+)\.({projs})\.weight")
    fused = re.compile(rf"model\.layers\.(\d+)\.({modules})\.experts\.(gate_up_proj|down_proj)")
    layer_of = re.compile(r"model\.layers\.(\d+)\.")
    layers: dict[int, LayerTensors] = {}
    dense = []
    for name, info in tensors.items():
        m = layer_of.match(name)
        if m and int(m[1]) >= config.n_layers:
            raise CheckpointError(f"{src}: tensor {name!r} is in layer {m[1]}, but config.json says "
                                  f"num_hidden_layers={config.n_layers}; the config disagrees with the checkpoint")
        if ".experts." not in name:
            dense.append((name, info))
        elif m_per := per_expert.fullmatch(name):
            lt = layers.setdefault(int(m_per[1]), LayerTensors({}, {}, m_per[2]))
            lt.per_expert[int(m_per[3]), arch.projections.index(m_per[4])] = info
        elif m_fused := fused.fullmatch(name):
            layers.setdefault(int(m_fused[1]), LayerTensors({}, {}, m_fused[2])).fused[m_fused[3]] = info
        else:
            raise CheckpointError(f"{src}: unrecognised expert tensor {name!r}; expected "
                                  f"model.layers.N.{arch.moe_modules[0]}.experts.E.{arch.projections[0]}.weight "
                                  f"or the fused model.layers.N.mlp.experts.gate_up_proj")
    return layers, dense


def _layer_spans(layer: int, lt: LayerTensors | None, arch: Arch,
                 shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    """The gate, up and down byte ranges of every expert of decoder layer `layer`."""
    module = lt.module if lt else arch.moe_modules[0]
    prefix = f"model.layers.{layer}.{module}.experts"
    if lt is None or (lt.per_expert and lt.fused) or not (lt.per_expert or lt.fused):
        what = "both per-expert and fused" if lt else "no"
        raise CheckpointError(f"layer {layer} has {what} expert tensors; expected {prefix}.E."
                              f"{arch.projections[0]}.weight for every expert, or {prefix}.gate_up_proj")
    if lt.fused:
        return _fused_spans(layer, lt, prefix, shape)
    return _per_expert_spans(layer, lt, prefix, arch, shape)


def _per_expert_spans(layer: int, lt: LayerTensors, prefix: str, arch: Arch,
                      shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    h, i, n = shape.hidden, shape.intermediate, shape.n_experts
    seen = sorted({e for e, _ in lt.per_expert})
    if seen[-1] >= n or (len(seen) < n and seen == list(range(len(seen)))):
        raise CheckpointError(f"config.json says {n} experts, but layer {layer} has tensors for "
                              f"experts {seen[0]}..{seen[-1]}; the config disagrees with the checkpoint")
    spans = []
    for e in range(n):
        parts = []
        for role, want in enumerate([(i, h), (i, h), (h, i)]):
            name = f"{prefix}.{e}.{arch.projections[role]}.weight"
            info = lt.per_expert.get((e, role))
            if info is None:
                raise CheckpointError(f"missing expert tensor {name}; the checkpoint is incomplete")
            _check_shape(info, want, shape)
            parts.append(info.span)
        spans.append(tuple(parts))
    return spans, {t.dtype for t in lt.per_expert.values()}


def _fused_spans(layer: int, lt: LayerTensors, prefix: str,
                 shape: StoreShape) -> tuple[list[tuple[Span, Span, Span]], set[str]]:
    h, i, n = shape.hidden, shape.intermediate, shape.n_experts
    for kind in ("gate_up_proj", "down_proj"):
        if kind not in lt.fused:
            raise CheckpointError(f"missing expert tensor {prefix}.{kind}; the checkpoint is incomplete")
    gate_up, down = lt.fused["gate_up_proj"], lt.fused["down_proj"]
    for info in (gate_up, down):
        if info.shape and info.shape[0] != n:
            raise CheckpointError(f"config.json says {n} experts, but {info.name} stacks {info.shape[0]}; "
                                  f"the config disagrees with the checkpoint")
    _check_shape(gate_up, (n, 2 * i, h), shape)
    _check_shape(down, (n, h, i), shape)
    part = h * i * DTYPES.get(gate_up.dtype, ("", 0))[1]
    g, d = gate_up.span, down.span
    spans = [(Span(g.file, g.offset + 2 * e * part, part), Span(g.file, g.offset + (2 * e + 1) * part, part),
              Span(d.file, d.offset + e * part, part)) for e in range(n)]
    return spans, {gate_up.dtype, down.dtype}


def _check_shape(info: TensorInfo, want: tuple[int, ...], shape: StoreShape) -> None:
    if info.shape != want:
        raise CheckpointError(f"tensor {info.name} has shape {list(info.shape)}, but config.json (hidden_size="
                              f"{shape.hidden}, expert intermediate size {shape.intermediate}) implies {list(want)}; "
                              f"the config disagrees with the checkpoint")


def _check_dense_shapes(dense: dict[str, TensorInfo], config: MoEConfig, arch: Arch) -> None:
    """Embeddings, LM head and routers are where a config that disagrees with the weights shows."""
    want = {"model.embed_tokens.weight": (config.vocab_size, config.dim),
            "lm_head.weight": (config.vocab_size, config.dim)}
    for layer in config.moe_layer_ids:
        for module in arch.moe_modules:
            want[f"model.layers.{layer}.{module}.gate.weight"] = (config.n_experts, config.dim)
    for name, shape in want.items():
        if name in dense and dense[name].shape != shape:
            raise CheckpointError(f"tensor {name} has shape {list(dense[name].shape)}, but config.json (vocab_size="
                                  f"{config.vocab_size}, hidden_size={config.dim}, {config.n_experts} experts) "
                                  f"implies {list(shape)}; the config disagrees with the checkpoint")


def _saved_name(name: str, arch: Arch) -> str:
    """The name save_pretrained gives a dense tensor: a fused-layout Mixtral router lives in `mlp.gate`."""
    if arch.moe_modules[0] != "mlp":
        return re.sub(r"^(model\.layers\.\d+)\.mlp\.gate\.", rf"\1.{arch.moe_modules[0]}.gate.", name)
    return name
