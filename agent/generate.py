"""flashmoe-cli generate: run the model with routed experts streamed from the SSD through the expert cache.

Examples:
    flashmoe-cli generate --model data/demo --prompt "Hello" --max-new-tokens 32 --greedy
    flashmoe-cli generate --model data/demo --prompt-ids 1,2,3 --max-new-tokens 16 --greedy \\
        --cache-cap 25% --policy lru --backend direct --no-prefetch --record-trace run.jsonl --json

The prompt is processed token by token by default (`--prefill sequential`), so every model step
routes one token and the recorded trace has one record per token exactly like the decode traces in
../shared/traces; `--prefill batched` runs the prompt in one step (one union per layer, recorded as
one record) and needs a cache that holds that union. `--record-trace` writes what the cache was
routed, step by step, and the monitoring samples the cache fed its policy, so replaying it with
`flashmoe-cli simulate` under the same cap, policy and scope with `--no-prefetch` gives the same
hits and misses, for the learned policy (which reacts to those samples) too.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent import argtypes
from agent.atomic_file import check_writable, write_atomically
from agent.experts.cache import CacheStats, ExpertCache
from agent.experts.cap import parse_cap
from agent.experts.layout import EXPERTS, INDEX, Index, StoreError
from agent.experts.provider import Expert, ExpertProvider
from agent.model.config import ConfigError, MoEConfig
from agent.model.generation import Generation, generate
from agent.model.loading import check_dense, load_model
from agent.model.model import Transformer
from agent.policies import DEFAULT_POLICY
from agent.prefetch_gate import check_mode
from agent.serve.scrub import truncated
from agent.tokenizer import load_tokenizer
from agent.traces import is_decode_jsonl
from agent.workers import DEFAULT_WORKERS

log = logging.getLogger(__name__)

PREFILL_MODES = ("sequential", "batched")
TRACE = ("the routing trace", "--record-trace")   # what write_trace writes, and the flag that names it


class RoutingRecorder:
    """An ExpertProvider in front of another: passes every call through and keeps each step's routed
    sets, and the monitoring samples the cache fed its policy at the start of a route (with the
    layer), so that a replay of the trace feeds them at the same points."""

    def __init__(self, inner: ExpertProvider) -> None:
        self.inner = inner
        self.records: list[dict[str, list[int]]] = []
        self.samples: list[list[dict[str, float]]] = []  # per step: {"layer": L, **sample}
        self._current: dict[str, list[int]] = {}
        self._samples: list[dict[str, float]] = []

    def route(self, layer: int, experts: list[int]) -> Sequence[int] | None:
        self._current[str(layer)] = sorted(experts)
        fed = getattr(self.inner, "system_fed", None)
        order = self.inner.route(layer, experts)  # the cache's fetch order, for its read-ahead
        if fed is not None and self.inner.system_fed[0] != fed[0]:
            self._samples.append({"layer": layer, **self.inner.system_fed[1]})
        return order

    def get(self, layer: int, expert: int) -> Expert:
        return self.inner.get(layer, expert)

    def done(self, layer: int, expert: int) -> None:
        self.inner.done(layer, expert)

    def prefetch(self, layer: int, experts: list[int]) -> None:
        self.inner.prefetch(layer, experts)

    def end_step(self) -> None:
        self.records.append(self._current)
        self.samples.append(self._samples)
        self._current, self._samples = {}, []


@dataclass
class GenerateResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "text": self.text, "stats": self.stats}


class TraceNotWritten(ValueError):
    """The tokens were generated but their routing trace could not be written (a full disk): `result`
    holds what was generated, so it is not lost with the trace."""

    def __init__(self, message: str, result: GenerateResult) -> None:
        super().__init__(message)
        self.result = result


def run_generate(model: Path, prompt: str | None = None, prompt_ids: list[int] | None = None,
                 max_new_tokens: int = 32, greedy: bool = False, cache_cap: str = "100%", policy: str = DEFAULT_POLICY,
                 scope: str = "layer", backend: str = "direct", prefetch: str = "auto", prefill: str = "sequential",
                 record_trace: Path | None = None, seed: int = 0, route_trace: Sequence[Path] = (),
                 int8_activations: bool = True, workers: int = DEFAULT_WORKERS,
                 dense: str = "stored") -> GenerateResult:
    """Generate from an expert store; the library function behind the command (same parameter names)."""
    check_mode(prefetch)
    check_dense(dense)
    model = Path(model)
    if not model.is_dir():
        raise ValueError(f"--model {model} is not a directory; give an expert store written by "
                         "flashmoe-cli convert or flashmoe-cli init-demo")
    if record_trace is not None:     # before the model runs, not after
        check_writable(Path(record_trace), *TRACE, ours=is_decode_jsonl)
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
    tokenizer = load_tokenizer(model)
    ids = list(prompt_ids) if prompt_ids is not None else list(tokenizer.encode(prompt or ""))
    index = Index.load(model / INDEX)
    cap = parse_cap(cache_cap, index.nbytes * len(index.blocks))
    with ExpertCache(model, cap, policy=policy, scope=scope, backend=backend,
                     int8_activations=int8_activations, prefetch=prefetch) as cache:
        _check_not_truncated(model, index)
        recorder = RoutingRecorder(cache)
        net = load_model(model, recorder, prefetch=prefetch != "off", route_trace=route_trace, workers=workers,
                         dense=dense, int8_activations=int8_activations)
        try:
            prefill_steps, after_prefill = (1 if prefill == "batched" else len(ids)), []

            def on_step() -> None:
                recorder.end_step()
                if len(recorder.records) == prefill_steps:
                    after_prefill.append((cache.stats(), dict(net.profile.seconds)))

            cache.session()
            gen = generate(net, ids, max_new_tokens, greedy=greedy, seed=seed, stop_ids=_stop_ids(net.config),
                           prefill_chunk=None if prefill == "batched" else 1, on_step=on_step)
            cache.wait_for_reads()   # the last step's guess may still be reading: count it
            stats = _stats(gen, net, *after_prefill[0], cache.stats())
        finally:
            net.workers.close()      # with the cache: no helper thread outlives the run
    stats.update(prefetch=prefetch, prefill=prefill, steps=len(recorder.records), int8_activations=int8_activations,
                 workers=workers, dense=dense,
                 routing=net.route_trace.describe() if net.route_trace else "the model's router")
    result = GenerateResult(ids, gen.token_ids, tokenizer.decode(gen.token_ids), stats)
    if record_trace is not None:
        meta = {"model": model.name, "arch": net.config.arch, "prompt": prompt, "steps": len(recorder.records),
                "layers": len(net.config.moe_layer_ids), "top_k": net.config.top_k, "n_experts": net.config.n_experts,
                "prompt_tokens": len(ids), "decode": "greedy" if greedy else "sampled", "prefill": prefill,
                "prefetch": prefetch, "routing": stats["routing"], "source": "flashmoe-cli generate"}
        try:
            write_trace(Path(record_trace), meta, recorder.records, recorder.samples)
        except ValueError as exc:
            raise TraceNotWritten(str(exc), result) from None
    return result


def _stats(gen: Generation, net: Transformer, before: CacheStats, profile_before: dict[str, float],
           after: CacheStats) -> dict[str, Any]:
    """The whole run's cache counters, plus the decode steps' alone (the prefill's cold misses left out),
    and where a decode step's time went (ms per token, by phase)."""
    decode_steps = len(gen.token_ids) - 1
    hits, misses = after.hits - before.hits, after.misses - before.misses
    phases = {**net.profile.since(profile_before), **after.phases_since(before)}
    return {
        "hit_rate": after.hit_rate, "hits": after.hits, "misses": after.misses, "bytes_read": after.bytes_read,
        "mb_read_per_token": after.bytes_read / 1e6 / len(gen.token_ids),
        "decode_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "decode_mb_read_per_token": (after.bytes_read - before.bytes_read) / 1e6 / max(decode_steps, 1),
        "tokens_per_s": gen.tokens_per_s, "decode_tokens_per_s": gen.decode_tokens_per_s,
        "prefill_s": gen.prefill_s, "decode_s": gen.decode_s,
        "decode_io_busy": (after.io_busy_s - before.io_busy_s) / gen.decode_s if gen.decode_s > 0 else None,
        "prefetch_accuracy": net.lookahead.accuracy, "prefetch_predicted": net.lookahead.predicted,
        "prefetch_correct": net.lookahead.correct, "prefetches": after.prefetches,
        "prefetch_hits": after.prefetch_hits, "prefetch_gate": after.prefetch, "cap_bytes": after.cap_bytes,
        "capacity_slots": after.capacity,
        "policy": after.policy, "scope": after.scope, "backend": after.backend,
        "decode_profile_ms_per_token": {k: 1000 * v / max(decode_steps, 1) for k, v in phases.items()},
    }


def _check_not_truncated(model: Path, index: Index) -> None:
    """One clear error now rather than a failed read, and the log lines of its prefetch siblings, later.
    (The agent serves such a store and fails only the requests that reach a missing block.)"""
    damaged = truncated(model, index)
    if damaged:
        raise StoreError(f"{len(damaged)} of {len(index.blocks)} expert blocks are missing from the end of "
                         f"{model / EXPERTS}, first: {next(iter(damaged.values()))}")


def _stop_ids(config: MoEConfig) -> tuple[int, ...]:
    return () if config.eos_token_id is None else (config.eos_token_id,)


def write_trace(path: Path, meta: dict[str, Any], records: list[dict[str, list[int]]],
                samples: list[list[dict[str, float]]]) -> None:
    """The decode JSONL layout of ../shared/traces/README.md, written whole or not at all (agent.atomic_file);
    a step during which the cache fed its policy monitoring samples also has "system": [...]."""
    steps = [{"step": step, "routed": routed, **({"system": fed} if fed else {})}
             for step, (routed, fed) in enumerate(zip(records, samples))]
    lines = [json.dumps({"meta": meta})] + [json.dumps(step) for step in steps]
    write_atomically(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"), *TRACE, ours=is_decode_jsonl)


# -- command line ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--model", required=True, type=Path,
                        help="expert store directory (flashmoe-cli convert / init-demo)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, encoded with the model's tokenizer")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma separated: 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (default: sample at temperature 1)")
    parser.add_argument("--seed", type=argtypes.seed, default=0, help="sampling seed (default 0)")
    parser.add_argument("--cache-cap", default="100%", help="expert cache size: bytes (300000000, 300MB) or a share "
                        "of all expert bytes (25%%); default 100%%")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="replacement policy (default %(default)s)")
    parser.add_argument("--scope", choices=("layer", "global"), default="layer",
                        help="cache partitioning (default layer)")
    parser.add_argument("--backend", choices=("direct", "buffered", "mmap"), default="direct",
                        help="expert reads: O_DIRECT (default), buffered pread, or mmap of the whole file")
    argtypes.add_prefetch(parser, "auto")
    parser.add_argument("--prefill", choices=PREFILL_MODES, default="sequential",
                        help="prompt token by token (default) or in one batched step")
    parser.add_argument("--threads", type=argtypes.threads, default=1,
                        help="torch intra-op threads (default 1: the expert reads and their CRC checks run on "
                        "other threads, and one token's matmuls are small)")
    parser.add_argument("--workers", type=argtypes.threads, default=DEFAULT_WORKERS,
                        help="threads a step computes on, its own one of them: a step's experts run on them at "
                        "once and a decode token's large matvecs are split between them (default %(default)s: two "
                        "where the process may use two cores)")
    parser.add_argument("--record-trace", type=Path, metavar="FILE", help="write the routing as decode-layout JSONL")
    parser.add_argument("--route-trace", type=Path, nargs="+", default=(), metavar="FILE",
                        help="take each token's experts from recorded real routing (../shared/traces; it must match "
                        "the model's MoE layers, experts and top-k); the router still runs, its choice is discarded")
    argtypes.add_int8_activations(parser)
    argtypes.add_dense(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r}: give integers separated by commas, "
                                         "e.g. 1,2,3") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty; give at least one token id, e.g. 1,2,3")
    return ids


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    try:
        result = run_generate(args.model, args.prompt, args.prompt_ids, args.max_new_tokens, args.greedy,
                              args.cache_cap, args.policy, args.scope, args.backend, args.prefetch, args.prefill,
                              args.record_trace, args.seed, args.route_trace, args.int8_activations, args.workers,
                              args.dense)
    except TraceNotWritten as exc:   # a full disk: the text is shown, then why its trace is not there
        _show(exc.result, args.json)
        log.error("%s; the generation above ran, its trace was not written", exc)
        return 2
    except OSError as exc:
        log.error("%s", exc)  # args[0] of an OSError is its errno
        return 2
    except (ValueError, StoreError, ConfigError) as exc:
        log.error("%s", exc.args[0] if exc.args else exc)
        return 2
    _show(result, args.json)
    return 0


def _show(result: GenerateResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_json()))
        return
    s = result.stats
    print(result.text)
    log.info("%d tokens, %.2f tok/s (decode %.2f tok/s), hit rate %.3f, %.1f MB read per token; %s",
             len(result.token_ids), s["tokens_per_s"], s["decode_tokens_per_s"], s["hit_rate"],
             s["mb_read_per_token"], s["routing"])
