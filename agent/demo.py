"""flashmoe-cli init-demo: a random-weight OLMoE-shaped model, written without transformers.

The output is exactly what `flashmoe-cli convert` makes of an OLMoE checkpoint (same config keys,
same dense tensor names, experts through the same StoreWriter), plus a byte-level tokenizer.json.
It is seeded, so every run writes identical bytes, and idempotent: a complete demo of the asked
size is left alone; anything else that init-demo wrote before is rebuilt.

Sizes: 64 experts, top-8 and OLMoE's attention layout (q/k norms over the full projection, no GQA)
are kept; layers and widths are cut so the model decodes at a usable speed on a 2-core CPU.
  default  8 layers, hidden 512, expert intermediate 512, float32: 64 x 8 blocks of 3 MiB = 1.5 GiB
  small    2 layers, hidden 64, expert intermediate 32: 3 MiB of experts, for tests
float32 rather than bfloat16: CPUs without bf16 units convert bf16 to fp32 for every matmul, so fp32
decodes faster for the same store size (half the parameters of a bf16 model of 1.5 GiB), and each
3 MiB block still costs a realistic multi-megabyte SSD read on a miss (OLMoE's bf16 blocks are 12 MiB).

Routing that looks like a trained model's: with i.i.d. router rows every expert is equally likely
and no cache policy matters. Here (see `_router`) each expert's router row is scaled by a Zipf-like
profile (rank r of 64 gets 1/(r+1)^ZIPF; a fresh permutation per layer), so some experts win the
top-8 far more often; each row also leans towards one of the byte-class directions (vowels,
consonants, digits, brackets, operators, ...) that the embeddings carry, so which experts are hot
shifts with the text (prose vs code); and sharp attention mixes particular earlier tokens into the
residual stream, so routing depends on context, not only on the current byte.
"""
from __future__ import annotations

import argparse
import json
import logging
import string
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.convert.errors import CheckpointError
from agent.convert.safetensors_io import payload_bytes
from agent.convert.store_writer import StoreShape, StoreWriter, check_outside_models, filled_up, followed
from agent.experts.layout import CONFIG, DENSE, EXPERTS, INDEX, Index, StoreError
from agent.shapes import SHAPES, ShapeError, init_shape, shape_config
from agent.tokenizer import TOKENIZER_JSON, byte_level_tokenizer_json

log = logging.getLogger(__name__)

N_EXPERTS, TOP_K = 64, 8
VOCAB, EOS = 257, 256          # byte ids 0..255 and <|endoftext|>
SEED, VERSION = 0, 1           # bump VERSION when the generated weights change: old demos get rebuilt
# Tuned (with transformers' OLMoE as the reference forward pass) so prose and code routing resemble the
# OLMoE-1B-7B decode traces in ../shared/traces: the 20% most used experts take ~55-60% of selections
# (OLMoE: 45-67%), 35-50% of tokens pick a top-8 set no earlier token picked (OLMoE: 40-75%), and
# consecutive tokens share ~2 of 8 experts (OLMoE: 2-4). Drift is weaker than OLMoE's: expert popularity
# of prose and code differs by a total-variation distance of ~0.15 (OLMoE: ~0.54), because a byte
# vocabulary has no topics, only byte-class statistics (which differ by ~0.17 between the two texts).
ZIPF = 0.3                     # router row scale of popularity rank r: 1 / (r + 1) ** ZIPF
CLASS_LEAN = 1.0               # how far a router row leans towards its token class (vs a random direction)
TOKEN_NOISE = 1.0              # each token's own embedding direction, relative to its class centre
ATTN_SHARPNESS = 16.0          # q/k norm weights: sharp attention makes routing depend on particular earlier
                               # tokens, not only on the current byte (a byte vocabulary alone gives few sets)
# Token classes by byte; the last class is every other byte. Code and prose differ most in these.
CLASSES = ("aeiou", "bcdfghjklmnpqrstvwxyz", string.ascii_uppercase, string.digits, " ", "\n\t\r",
           "()[]{}", "=+-*/<>%&|^~", ".,;:!?", "'\"`", "_#@$\\")
N_CLASSES = len(CLASSES) + 1
DEFAULT_OUT = Path("data/demo")


@dataclass(frozen=True)
class DemoSize:
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int


SIZES = {"default": DemoSize(n_layers=8, hidden=512, intermediate=512, n_heads=8),
         "small": DemoSize(n_layers=2, hidden=64, intermediate=32, n_heads=4)}


class DemoError(Exception):
    """init-demo cannot write where it was asked to; the message says why and what to do."""


def demo_config(size: str) -> dict:
    """The config.json transformers 5.24 writes for an OlmoeConfig of this size, plus our demo marker."""
    s = SIZES[size]
    return {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "dtype": "float32",
        "vocab_size": VOCAB, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_heads,
        "num_experts": N_EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": EOS, "pad_token_id": EOS, "initializer_range": 0.02,
        "router_aux_loss_coef": 0.01, "output_router_logits": False, "use_cache": True,
        "flashmoe_demo": {"size": size, "seed": SEED, "version": VERSION},
    }


def init_demo(out: Path = DEFAULT_OUT, size: str = "default") -> Path:
    """Write the demo model to `out` unless a complete one of this size is already there."""
    if size not in SIZES:
        raise DemoError(f"unknown demo size {size!r}; choose one of {', '.join(SIZES)}")
    out = followed(Path(out).expanduser(), "--out")
    config = demo_config(size)
    if is_complete(out, config):
        log.info("demo model in %s is complete (%s); nothing to do", out, size)
        return out
    check_outside_models(out, "--out")
    _check_replaceable(out)
    start = time.monotonic()
    write_demo(out, config)
    log.info("wrote the %s demo model to %s in %.1f s", size, out, time.monotonic() - start)
    return out


def is_complete(out: Path, config: dict) -> bool:
    """Cheap check (no CRC pass over the experts): same config, a loadable index, every file in full."""
    try:
        if json.loads((out / CONFIG).read_text()) != config:
            return False
        index = Index.load(out / INDEX)
        return ((out / EXPERTS).stat().st_size == len(index.blocks) * index.slot_bytes
                and (out / DENSE).is_file() and (out / TOKENIZER_JSON).is_file())
    except (OSError, ValueError, StoreError):
        return False


def _check_replaceable(out: Path) -> None:
    """Only an empty directory or an earlier demo may be replaced: never a user's converted model."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        ours = "flashmoe_demo" in json.loads((out / CONFIG).read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise DemoError(f"{out} exists and does not hold a FlashMoE demo model; choose another --out "
                        f"or remove it")


def write_demo(out: Path, config: dict) -> None:
    s = SIZES[config["flashmoe_demo"]["size"]]
    shape = StoreShape(s.n_layers, N_EXPERTS, s.hidden, s.intermediate, "float32", 4)
    dense_rng, expert_rng = (np.random.default_rng([SEED, stream]) for stream in (0, 1))
    dense, tokenizer = dense_tensors(dense_rng, s), byte_level_tokenizer_json()
    with StoreWriter(out, shape, replace=True) as writer:
        writer.check_room(payload_bytes(dense) + len(tokenizer.encode()), "--out")
        writer.write_config(config)
        writer.write_text(TOKENIZER_JSON, tokenizer)
        writer.write_dense(dense)
        for _ in range(writer.n_blocks):
            writer.add_block(lambda payload: _expert_block(expert_rng, s, payload))


# ---------------------------------------------------------------- weights

def token_classes() -> np.ndarray:
    """[VOCAB] the index in CLASSES of each token id's byte; len(CLASSES) for any other byte and for EOS."""
    classes = np.full(VOCAB, len(CLASSES), dtype=np.int64)
    for cls, chars in enumerate(CLASSES):
        classes[[ord(c) for c in chars]] = cls
    return classes


def dense_tensors(rng: np.random.Generator, s: DemoSize) -> list[tuple[str, np.ndarray]]:
    """Every non-expert tensor under the name a converted OLMoE checkpoint gives it, in HF's order."""
    h = s.hidden
    centers = rng.standard_normal((N_CLASSES, h), dtype=np.float32)
    noise = rng.standard_normal((VOCAB, h), dtype=np.float32)
    tensors = [("model.embed_tokens.weight", centers[token_classes()] + TOKEN_NOISE * noise)]
    for layer in range(s.n_layers):
        p = f"model.layers.{layer}."
        tensors += [(p + f"self_attn.{name}_proj.weight", _linear(rng, h, h))
                    for name in "qkvo"]
        qk_norm = np.full(h, np.sqrt(ATTN_SHARPNESS), np.float32)
        tensors += [(p + "self_attn.q_norm.weight", qk_norm), (p + "self_attn.k_norm.weight", qk_norm),
                    (p + "mlp.gate.weight", _router(rng, centers)),
                    (p + "input_layernorm.weight", np.ones(h, np.float32)),
                    (p + "post_attention_layernorm.weight", np.ones(h, np.float32))]
    tensors += [("model.norm.weight", np.ones(h, np.float32)), ("lm_head.weight", _lm_head(rng, h))]
    return tensors


def _linear(rng: np.random.Generator, n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
    """[n_out, n_in] with std scale/sqrt(n_in): unit-variance inputs give outputs of variance scale^2."""
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    w *= np.float32(scale / np.sqrt(n_in))
    return w


def _router(rng: np.random.Generator, centers: np.ndarray) -> np.ndarray:
    """[E, H] router rows: a Zipf-scaled blend of a random direction and one token-class direction."""
    rows = rng.standard_normal((N_EXPERTS, centers.shape[1]), dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    lean = centers[rng.integers(0, N_CLASSES, N_EXPERTS)]
    rows += CLASS_LEAN * lean / np.linalg.norm(lean, axis=1, keepdims=True)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    ranks = rng.permutation(N_EXPERTS)  # which expert gets which popularity rank differs per layer
    scale = (1.0 + ranks) ** -ZIPF
    # logits of an RMS-normalised hidden state (norm sqrt(H)) land within a few units, like a trained router's
    return (rows * (4.0 * scale / np.sqrt(centers.shape[1]))[:, None]).astype(np.float32)


def _lm_head(rng: np.random.Generator, h: int) -> np.ndarray:
    """Only printable ASCII gets non-zero logits, so the demo's (random) text is readable characters."""
    w = _linear(rng, VOCAB, h, scale=4.0)
    printable = np.zeros(VOCAB, dtype=bool)
    printable[[ord(c) for c in string.ascii_letters + string.digits + string.punctuation + " \n"]] = True
    w[~printable] = 0.0
    return w


def _expert_block(rng: np.random.Generator, s: DemoSize, payload: memoryview) -> None:
    """gate [I, H] and up [I, H] with std 1/sqrt(H), down [H, I] with std 1/sqrt(I): outputs of unit scale.

    Uniform rather than normal draws: 3x faster to generate, and 1.5 GiB of them is most of init-demo's time.
    """
    block = np.frombuffer(payload, dtype=np.float32)
    rng.random(out=block, dtype=np.float32)
    block -= np.float32(0.5)
    n = s.hidden * s.intermediate
    half_width = np.sqrt(12.0)  # uniform on [-0.5, 0.5) has std 1/sqrt(12)
    block[:2 * n] *= np.float32(half_width / np.sqrt(s.hidden))
    block[2 * n:] *= np.float32(half_width / np.sqrt(s.intermediate))


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("example:\n  flashmoe-cli init-demo --out data/demo\n"
                     "  flashmoe-cli init-demo --out /tmp/demo-small --size small\n"
                     "  flashmoe-cli init-demo --shape olmoe-1b-7b --out /work/models/olmoe-1b-7b --drop-hf\n\n"
                     "default: 8 layers x 64 experts (top-8), 1.5 GiB of float32 experts; small: 3 MiB.\n"
                     "--shape: a random-weight Hugging Face checkpoint with that model's real shapes and tensor\n"
                     "names in OUT/hf (bfloat16; olmoe-1b-7b 13 GB, qwen1.5-moe-a2.7b 29 GB, qwen3-30b-a3b 1.2 GB per\n"
                     "layer, deepseek-v2-lite 1.1 GB per MoE layer), converted by flashmoe-cli convert into OUT/store.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model directory (default {DEFAULT_OUT})")
    parser.add_argument("--size", choices=list(SIZES), default="default", help="default (1.5 GiB) or small (tests)")
    parser.add_argument("--shape", choices=list(SHAPES), help="a real model's shapes instead of the demo's")
    parser.add_argument("--layers", type=int, help="with --shape: keep only the first N decoder layers (disk)")
    parser.add_argument("--drop-hf", action="store_true",
                        help="with --shape: delete OUT/hf once every block of OUT/store passed its CRC check")


def run(args: argparse.Namespace) -> int:
    try:
        if args.shape:
            init_shape(shape_config(args.shape, args.layers), args.out, args.drop_hf)
        elif args.layers is not None or args.drop_hf:
            raise DemoError("--layers and --drop-hf apply only with --shape")
        else:
            init_demo(args.out, args.size)
    except (DemoError, ShapeError, CheckpointError, StoreError) as exc:
        log.error("init-demo failed: %s", exc)
        return 1
    except OSError as exc:
        log.error("init-demo failed: %s", filled_up(exc, args.out, "--out") or exc)
        return 1
    return 0
