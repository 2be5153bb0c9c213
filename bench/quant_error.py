"""How far int8 experts move the model: next-token distributions of an int8 store against its source.

    .venv/bin/python bench/quant_error.py [--pair PLAIN_STORE INT8_STORE] [--tokens 64] [--cap 2GB]

The parity checkpoints (tests/hf_models.py: tiny random-weight OLMoE, Qwen3-MoE, Qwen2-MoE and
Mixtral, in float32 and bfloat16) are converted twice, as they are and with --quantize int8; with
--pair, two stores converted from one checkpoint (e.g. the OLMoE-1B-7B-shaped model) are compared as
well, their experts read through the cache (O_DIRECT, LRU, --cap). Each model reads the same seeded
random token sequence teacher-forced: its first half as one prefill step (many tokens per expert: the
conversion path of agent/experts/quant.py), then one token per step (decode: the int8 kernel in
bf16). At every position: the largest |logit difference|, KL(source || int8) of the next-token
distribution, and whether the top token agrees. JSON: bench/results/quant_error.json.

Whether int4 would pay: the parity rows also run with every expert weight rounded to symmetric int4
in groups of --int4-group along its input (scale max |w| / 7 per group) and back, in RAM: the error
an int4 store of that layout would give, without a kernel for it.
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
from agent.experts.provider import ExpertProvider, ExpertWeights, InMemoryExperts
from agent.model.config import MoEConfig
from agent.model.loading import load_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
sys.path.insert(0, str(ROOT / "tests"))  # the parity checkpoints
from bench.common import count, machine, write_results  # noqa: E402
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


def sequence_logits(store: Path, provider: ExpertProvider, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: the first half as one prefill step, then one token per step."""
    model = load_model(store, provider)
    seq, half = model.new_sequence(len(ids)), len(ids) // 2
    out = [model.step([(seq, torch.tensor(ids[:half]))], all_logits=True)[0]]
    out += [model.step([(seq, torch.tensor([t]))], all_logits=True)[0] for t in ids[half:]]
    return torch.cat(out)


def token_ids(vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


class Int4RoundTrip:
    """Another provider's experts with every weight rounded to int4 groups and back: an int4 store's error."""

    def __init__(self, inner: ExpertProvider, group: int) -> None:
        self.inner, self.group = inner, group

    def route(self, layer: int, experts: list[int]) -> list[int] | None:
        return self.inner.route(layer, experts)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights(*(int4_round_trip(w, self.group) for w in self.inner.get(layer, expert)))

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.inner.prefetch(layer, experts)


def int4_round_trip(w: torch.Tensor, group: int) -> torch.Tensor:
    rows, cols = w.shape
    g = group if cols % group == 0 else cols
    w32 = w.float().view(rows, cols // g, g)
    scale = w32.abs().amax(dim=-1, keepdim=True) / 7
    scale = torch.where(scale > 0, scale, 1.0)
    return (torch.round(w32 / scale).clamp(-8, 7) * scale).view(rows, cols).to(w.dtype)


def parity(tokens: int, int4_group: int) -> list[Error]:
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            for name, dtype in DTYPES.items():
                work = Path(tmp) / f"{arch}-{name}"
                ckpt = tiny_checkpoint(arch, work / "hf", dtype=dtype)
                ids = token_ids(ckpt.model.config.vocab_size, tokens)
                plain, int8 = _converted(ckpt.path, work / "plain"), _converted(ckpt.path, work / "int8", "int8")
                ref = sequence_logits(plain, InMemoryExperts(plain), ids)
                label = f"{arch} {name} (tiny parity checkpoint)"
                errors.append(compare(ref, sequence_logits(int8, InMemoryExperts(int8), ids), f"{label}, int8"))
                int4 = Int4RoundTrip(InMemoryExperts(plain), int4_group)
                errors.append(compare(ref, sequence_logits(plain, int4, ids), f"{label}, int4 g{int4_group} simulated"))
    return errors


def pair(plain: Path, int8: Path, tokens: int, cap: str, int4_group: int) -> list[Error]:
    """Two stores of one checkpoint, their experts read through the cache with the same cap in bytes;
    the plain store's experts also rounded through int4 groups."""
    index = Index.load(plain / INDEX)
    cap_bytes = parse_cap(cap, index.nbytes * len(index.blocks))
    ids = token_ids(MoEConfig.from_file(plain / CONFIG).vocab_size, tokens)
    logits = {}
    for name, store, wrap in [("plain", plain, None), ("int8", int8, None),
                              (f"int4 g{int4_group} simulated", plain, lambda c: Int4RoundTrip(c, int4_group))]:
        with ExpertCache(store, cap_bytes, policy="lru", backend="direct") as cache:
            logits[name] = sequence_logits(store, wrap(cache) if wrap else cache, ids)
    ref = logits.pop("plain")
    return [compare(ref, got, f"{plain}, {name}") for name, got in logits.items()]


def _converted(src: Path, dst: Path, quantize: str | None = None) -> Path:
    convert(src, dst, quantize=quantize)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", nargs=2, type=Path, action="append", default=[], metavar=("PLAIN", "INT8"),
                        help="two stores of one checkpoint, unquantized and int8 (repeatable)")
    parser.add_argument("--tokens", type=count, default=64, help="length of the token sequence")
    parser.add_argument("--cap", default="2GB", help="cache cap for --pair stores")
    parser.add_argument("--int4-group", type=count, default=32, help="group size of the simulated int4 rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    errors = parity(args.tokens, args.int4_group)
    for plain, int8 in args.pair:
        errors += pair(plain, int8, args.tokens, args.cap, args.int4_group)
    print("| model | positions | max logit diff | largest logit | mean KL | max KL | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for e in errors:
        print(f"| {e.model} | {e.positions} | {e.max_logit_diff:.4f} | {e.largest_logit:.2f} | {e.mean_kl:.2e} | "
              f"{e.max_kl:.2e} | {e.top1_agreement:.3f} |")
    write_results("quant_error", {"tokens": args.tokens, "int4_group": args.int4_group,
                                  "errors": [asdict(e) for e in errors],
                                  "pairs": [[str(p), str(q)] for p, q in args.pair], "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
