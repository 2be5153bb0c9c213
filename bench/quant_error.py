"""How far quantized weights move the model: next-token distributions of int8 and int4 stores, and of int8
dense linears (--dense int8), against their source.

    .venv/bin/python bench/quant_error.py [--pair PLAIN_STORE QUANTIZED_STORE]... [--dense STORE]...
                                          [--tokens 64] [--prefill N] [--no-parity] [--cap 2GB]
                                          [--results quant_error]

The parity checkpoints (tests/hf_models.py: tiny random-weight OLMoE, Qwen3-MoE, Qwen2-MoE and
Mixtral, in float32 and bfloat16) are converted three times, as they are and with --quantize int8 and
int4; with --pair, two stores converted from one checkpoint (e.g. the OLMoE-1B-7B-shaped model and its
int8 or int4 twin) are compared as well, their experts read through the cache (O_DIRECT, LRU, --cap);
--no-parity leaves the parity checkpoints out (their 128 positions are too few for a long --prefill).
Dense linears in int8 (agent/model/dense_int8.py; W8A8 above 8 tokens, as the runtime computes them):
each parity checkpoint's plain store and int8 store with them, against the plain store; with --dense,
a store (e.g. the OLMoE-1B-7B-shaped int8 one) with them against itself as stored, experts through the
cache as for --pair: the dense linears' error alone.
Each model reads the same seeded random token sequence teacher-forced: its first --prefill tokens (half
by default) as one prefill step (many tokens per expert), then one token per step (decode). An int8
store is measured twice: as the runtime computes it (bf16 activations quantized to int8 above 8 tokens
per expert, agent/experts/quant.py) and with its weights only quantized (--int8-activations off, what the
runtime did before; float32 models compute that way either way). At every position: the largest
|logit difference|, KL(source || quantized) of the next-token distribution, and whether the top token
agrees.
JSON: bench/results/<--results>.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agent.convert import convert
from agent.experts.cache import ExpertCache
from agent.experts.cap import parse_cap
from agent.experts.layout import CONFIG, INDEX, Index
from agent.experts.provider import ExpertProvider, InMemoryExperts
from agent.model.config import MoEConfig
from agent.model.loading import load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
sys.path.insert(0, str(ROOT / "tests"))  # the parity checkpoints
from bench.common import count, machine, results_name, write_results  # noqa: E402
from hf_models import ARCHS, tiny_checkpoint  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Error:
    model: str
    positions: int
    max_logit_diff: float
    largest_logit: float     # of the source model: what the difference is measured against
    mean_kl: float
    max_kl: float
    top1_agreement: float


def compare(ref: torch.Tensor, got: torch.Tensor, model: str) -> Error:
    """ref, got: [positions, V] logits of the source and of the int8 model."""
    p, q = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return Error(model, len(ref), (got - ref).abs().max().item(), ref.abs().max().item(), kl.mean().item(),
                 kl.max().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item())


def sequence_logits(store: Path, provider: ExpertProvider, ids: list[int], prefill: int,
                    dense: str = "stored") -> torch.Tensor:
    """[len(ids), V]: the first `prefill` as one step, then one token per step; the dense linears `dense`."""
    model = load_model(store, provider, dense=dense)
    seq = model.new_sequence(len(ids))
    out = [model.step([(seq, torch.tensor(ids[:prefill]))], all_logits=True)[0]]
    out += [model.step([(seq, torch.tensor([t]))], all_logits=True)[0] for t in ids[prefill:]]
    return torch.cat(out)


def ways(quantized: str) -> list[tuple[str, bool]]:
    """How a store of `quantized` is computed, each with its int8_activations option: int8 with its
    activations quantized where the runtime does, and with its weights only (--int8-activations off)."""
    return [("int8 W8A8", True), ("int8 weights only", False)] if quantized == "int8" else [(quantized, True)]


def token_ids(vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


QUANTS = ("int8", "int4")
DENSE_INT8 = "int8 dense W8A8"   # the dense linears int8 (--dense int8), their activations too above 8 tokens


def parity(tokens: int, prefill: int) -> list[Error]:
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            for name, dtype in DTYPES.items():
                work = Path(tmp) / f"{arch}-{name}"
                ckpt = tiny_checkpoint(arch, work / "hf", dtype=dtype)
                ids = token_ids(ckpt.model.config.vocab_size, tokens)
                plain = _converted(ckpt.path, work / "plain")
                ref = sequence_logits(plain, InMemoryExperts(plain), ids, prefill)
                label = f"{arch} {name} (tiny parity checkpoint)"
                got = sequence_logits(plain, InMemoryExperts(plain), ids, prefill, "int8")
                errors.append(compare(ref, got, f"{label}, {DENSE_INT8}"))
                for quantized in QUANTS:
                    store = _converted(ckpt.path, work / quantized, quantized)
                    for way, activations in ways(quantized):
                        got = sequence_logits(store, InMemoryExperts(store, int8_activations=activations), ids, prefill)
                        errors.append(compare(ref, got, f"{label}, {way}"))
                    if quantized == "int8":
                        got = sequence_logits(store, InMemoryExperts(store), ids, prefill, "int8")
                        errors.append(compare(ref, got, f"{label}, int8 W8A8 + {DENSE_INT8}"))
    return errors


def dense_alone(stores: list[Path], tokens: int, prefill: int, cap: str) -> list[Error]:
    """Each store with its dense linears in int8 against itself as stored, experts read through the cache
    with `cap` (bytes, or a share of the store's expert bytes)."""
    errors = []
    for store in stores:
        index = Index.load(store / INDEX)
        cap_bytes = parse_cap(cap, index.nbytes * len(index.blocks))
        ids = token_ids(MoEConfig.from_file(store / CONFIG).vocab_size, tokens)
        ref = _cached_logits(store, cap_bytes, ids, prefill)
        errors.append(compare(ref, _cached_logits(store, cap_bytes, ids, prefill, dense="int8"),
                              f"{store} ({DENSE_INT8}, against its dense weights as stored)"))
    return errors


def pairs(stores: list[tuple[Path, Path]], tokens: int, prefill: int, cap: str) -> list[Error]:
    """Each (plain, quantized) pair of stores of one checkpoint, their experts read through the cache
    with the same cap in bytes (that of the plain store's `cap`)."""
    refs, errors = {}, []
    for plain, quantized in stores:
        index = Index.load(plain / INDEX)
        cap_bytes = parse_cap(cap, index.nbytes * len(index.blocks))
        ids = token_ids(MoEConfig.from_file(plain / CONFIG).vocab_size, tokens)
        if plain not in refs:
            refs[plain] = _cached_logits(plain, cap_bytes, ids, prefill)
        for way, activations in ways(Index.load(quantized / INDEX).quant):
            got = _cached_logits(quantized, cap_bytes, ids, prefill, activations)
            errors.append(compare(refs[plain], got, f"{quantized} ({way})"))
    return errors


def _cached_logits(store: Path, cap_bytes: int, ids: list[int], prefill: int,
                   int8_activations: bool = True, dense: str = "stored") -> torch.Tensor:
    with ExpertCache(store, cap_bytes, policy="lru", backend="direct", int8_activations=int8_activations) as cache:
        return sequence_logits(store, cache, ids, prefill, dense)


def _converted(src: Path, dst: Path, quantize: str | None = None) -> Path:
    convert(src, dst, quantize=quantize)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", nargs=2, type=Path, action="append", default=[], metavar=("PLAIN", "QUANTIZED"),
                        help="two stores of one checkpoint, unquantized and int8 or int4 (repeatable)")
    parser.add_argument("--dense", type=Path, action="append", default=[], metavar="STORE",
                        help="a store to measure with its dense linears in int8 against itself (repeatable)")
    parser.add_argument("--tokens", type=count, default=64, help="length of the token sequence")
    parser.add_argument("--prefill", type=count, help="tokens of the prefill step (default: half of --tokens)")
    parser.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the parity checkpoints (--no-parity: the --pair stores only)")
    parser.add_argument("--cap", default="2GB", help="cache cap for --pair and --dense stores")
    parser.add_argument("--results", type=results_name, default="quant_error",
                        help="name of the JSON in bench/results/")
    args = parser.parse_args(argv)
    prefill = args.prefill or args.tokens // 2
    if prefill > args.tokens:
        parser.error(f"--prefill {prefill} is more than --tokens {args.tokens}")
    torch.set_num_threads(1)
    errors = ((parity(args.tokens, prefill) if args.parity else []) + pairs(args.pair, args.tokens, prefill, args.cap)
              + dense_alone(args.dense, args.tokens, prefill, args.cap))
    print("| model | positions | max logit diff | largest logit | mean KL | max KL | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for e in errors:
        print(f"| {e.model} | {e.positions} | {e.max_logit_diff:.4f} | {e.largest_logit:.2f} | {e.mean_kl:.2e} | "
              f"{e.max_kl:.2e} | {e.top1_agreement:.3f} |")
    write_results(args.results, {"tokens": args.tokens, "prefill": prefill,
                                  "errors": [asdict(e) for e in errors],
                                  "pairs": [[str(p), str(q)] for p, q in args.pair],
                                  "dense": [str(d) for d in args.dense], "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
