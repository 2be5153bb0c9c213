"""flashmoe-cli warmup: find the hot experts of a prompt file and preload them into the agent.

Examples:
    flashmoe-cli warmup examples/benchmark_input.json --agent-url http://127.0.0.1:8600
    flashmoe-cli --warmup examples/benchmark_input.json            # same, default agent URL
    flashmoe-cli warmup examples/benchmark_input.json --model data/demo --json   # report only

The file is JSON: {"prompts": [text or [token ids], ...], "max_tokens": N}; keys starting with "_"
are comments. Each prompt is generated greedily for max_tokens tokens through the model's routers,
here in this process (the model directory comes from --model, or from the running agent's status),
counting how often every (layer, expert) is routed. The most-routed experts of each layer, as many
as the agent's cache holds per layer (or --per-layer), are the hot set; with an agent it is sent to
POST /v1/cache/preload, otherwise it is reported.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from access.address import url_problem
from access.answer_shape import Shape, shape_problem
from agent.token_option import TokenError, add_token_arguments, token_from

log = logging.getLogger(__name__)

DEFAULT_AGENT_URL = "http://127.0.0.1:8600"
ROUTING_CAP = "25%"   # the cap of this process's own cache while it runs the prompts


class WarmupError(Exception):
    """The prompt file or the agent cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Prompts:
    prompts: list[str | list[int]]
    max_tokens: int


@dataclass
class HotExperts:
    experts: list[tuple[int, int]]          # the hot set, layer by layer, most routed first
    routed: int                             # routing decisions counted (per step, per expert)
    covered: int                            # of them, to an expert in the hot set
    prompts: int
    tokens: int

    @property
    def coverage(self) -> float:
        return self.covered / self.routed if self.routed else 0.0


def load_prompts(path: Path) -> Prompts:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise WarmupError(f"{path} not found; see examples/benchmark_input.json for the format") from None
    except OSError as exc:      # a directory, no permission
        raise WarmupError(f"cannot read {path}: {exc.strerror}; give a prompt file such as "
                          f"examples/benchmark_input.json") from None
    except UnicodeDecodeError:
        raise WarmupError(f"{path} is not a text file (not UTF-8); give a JSON prompt file such as "
                          f"examples/benchmark_input.json") from None
    except json.JSONDecodeError as exc:
        raise WarmupError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not data["prompts"]:
        raise WarmupError(f'{path}: expected {{"prompts": [text or [token ids], ...], "max_tokens": N}} '
                          f"with at least one prompt")
    for i, p in enumerate(data["prompts"]):
        ok = (isinstance(p, str) and p) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p))
        if not ok:
            raise WarmupError(f"{path}: prompts[{i}] must be non-empty text or a non-empty list of token ids")
    max_tokens = data.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WarmupError(f"{path}: max_tokens must be a whole number >= 1, got {max_tokens!r}")
    return Prompts(data["prompts"], max_tokens)


def route_counts(model_dir: Path, prompts: Prompts) -> tuple[Counter, int]:
    """Run every prompt through the model (greedy) and count the routers' choices; returns (counts, tokens)."""
    from agent.experts.cache import ExpertCache
    from agent.experts.cap import cap_bounds, parse_cap, resident_bytes
    from agent.experts.layout import INDEX, Index
    from agent.model.config import MoEConfig
    from agent.model.generation import generate
    from agent.model.loading import load_model
    from agent.serve.engine import RouteCounter
    from agent.tokenizer import load_tokenizer

    index, config = Index.load(model_dir / INDEX), MoEConfig.from_file(model_dir / "config.json")
    lo, hi = cap_bounds(index, config.top_k, reserved=resident_bytes(model_dir, index))
    cap = min(max(parse_cap(ROUTING_CAP, index.nbytes * len(index.blocks)), lo), hi)
    tokenizer = load_tokenizer(model_dir)
    stop = () if config.eos_token_id is None else (config.eos_token_id,)
    counts, tokens = Counter(), 0
    with ExpertCache(model_dir, cap) as cache:
        counter = RouteCounter(cache)
        model = load_model(model_dir, counter, prefetch=False)
        for p in prompts.prompts:
            ids = list(tokenizer.encode(p)) if isinstance(p, str) else p
            tokens += len(generate(model, ids, prompts.max_tokens, greedy=True, stop_ids=stop).token_ids)
        counts.update(counter.take())
    return counts, tokens


def hot_set(counts: Counter, n_layers: int, per_layer: int) -> list[tuple[int, int]]:
    """The `per_layer` most-routed experts of each layer (ties by expert id, for a stable answer)."""
    hot = []
    for layer in range(n_layers):
        ranked = sorted(((-n, e) for (l, e), n in counts.items() if l == layer))
        hot.extend((layer, e) for _, e in ranked[:per_layer])
    return hot


def find_hot_experts(model_dir: Path, prompts: Prompts, per_layer: int) -> HotExperts:
    from agent.experts.layout import INDEX, Index

    n_layers = Index.load(Path(model_dir) / INDEX).n_layers
    counts, tokens = route_counts(Path(model_dir), prompts)
    hot = hot_set(counts, n_layers, per_layer)
    return HotExperts(hot, sum(counts.values()), sum(counts[k] for k in hot), len(prompts.prompts), tokens)


# -- the agent ---------------------------------------------------------------------------------------
AGENT_TIMEOUT_S = 300.0   # for a whole answer: a preload of many experts on a slow disk takes minutes


def _agent(method: str, url: str, token: str | None, shape: Shape, **kwargs: Any) -> dict[str, Any]:
    import httpx

    from access.whole_answer import AnswerTooLarge, read_whole

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client() as http:
            response = read_whole(http, method, url, AGENT_TIMEOUT_S, headers=headers, **kwargs)
    except httpx.TimeoutException:
        raise WarmupError(f"the agent at {url} did not answer {method} whole within {AGENT_TIMEOUT_S:g} s: it is "
                          f"busy, or no FlashMoE agent (pass the agent's address as --agent-url)") from None
    except httpx.TransportError as exc:
        raise WarmupError(f"the agent at {url} did not answer ({type(exc).__name__}); start it with "
                          f"flashmoe-cli serve, or pass --model DIR to only report the hot experts") from None
    except AnswerTooLarge as exc:
        raise WarmupError(f"{url} is not a FlashMoE agent: it answered {method} with {exc}; pass the agent's "
                          f"address as --agent-url (default {DEFAULT_AGENT_URL})") from None
    if response.status_code >= 400:
        raise WarmupError(f"the agent refused {method} {url} with {answered(response)}")
    return agent_answer(response, shape)


def answered(response: Any) -> str:
    """The status and the agent's own reason (its OpenAI-style error message), on one line: httpx's message
    named only the status, and the raw body, cut at 300 characters, repeated the reason and lost its end."""
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):   # not the agent's error shape: a proxy's page, say
        reason = response.text[:300]
    return f"{response.status_code}: {' '.join(str(reason).split())}"


def agent_answer(response: Any, shape: Shape) -> dict[str, Any]:
    """The JSON object an httpx `response` holds if it has `shape` (access.answer_shape), else a WarmupError saying
    the address is no FlashMoE agent: another service there (the dashboard's port, another model server) answers
    HTML or JSON of another shape, which was a traceback."""
    method, url = response.request.method, str(response.request.url).split("?")[0]
    try:
        answer = response.json()
    except ValueError:   # e.g. the dashboard's port, which answers every path with its HTML page
        media = response.headers.get("content-type", "no content type")
        raise WarmupError(f"{url} is not a FlashMoE agent: it answered {method} with something other than JSON "
                          f"({media}); pass the agent's address as --agent-url (default {DEFAULT_AGENT_URL})") from None
    if problem := shape_problem(answer, shape):
        raise WarmupError(f"{url} is not a FlashMoE agent: it answered {method} {problem}; pass the agent's address "
                          f"as --agent-url (default {DEFAULT_AGENT_URL})")
    return answer


def check_agent_url(url: str) -> None:
    """A WarmupError if --agent-url is no address an agent could answer at (httpx raised InvalidURL for some)."""
    if problem := url_problem(url):
        raise WarmupError(f"--agent-url {url!r} is not an agent's address: {problem}; pass the address "
                          f"`flashmoe-cli serve` listens on (default {DEFAULT_AGENT_URL})")


def agent_status(agent_url: str) -> dict[str, Any]:
    return _agent("GET", f"{agent_url}/v1/status", None, {"model": str, "cache": {"capacity_experts": int}},
                  params={"step_profiles": 0})


def preload(agent_url: str, experts: list[tuple[int, int]], token: str | None) -> dict[str, Any]:
    return _agent("POST", f"{agent_url}/v1/cache/preload", token,
                  {"loaded": int, "status": {"resident_experts": int, "capacity_experts": int}},
                  json={"experts": [list(k) for k in experts]})


def warmup(file: Path, agent_url: str | None = None, model: Path | None = None, per_layer: int | None = None,
           token: str | None = None) -> dict[str, Any]:
    """The library function behind the command (same parameter names); returns the report."""
    from agent.experts.layout import INDEX, Index, StoreError

    prompts = load_prompts(file)
    status = agent_status(agent_url) if agent_url else None
    model_dir = Path(model or status["model"])
    try:
        index = Index.load(model_dir / INDEX)
        if per_layer is None:
            per_layer = (status["cache"]["capacity_experts"] // index.n_layers) if status else index.n_experts // 4
        if not 1 <= per_layer <= index.n_experts:
            raise WarmupError(f"--per-layer must be between 1 and {index.n_experts}, got {per_layer}")
        hot = find_hot_experts(model_dir, prompts, per_layer)
    except (StoreError, ValueError, OSError) as exc:  # ValueError: a bad config.json, tokenizer or prompt length
        raise WarmupError(f"cannot find the hot experts of {model_dir}: {exc}") from None
    report = {"model": str(model_dir), "per_layer": per_layer, **asdict(hot), "coverage": hot.coverage}
    if agent_url:
        answer = preload(agent_url, hot.experts, token)
        report["preloaded"] = answer["loaded"]
        report["agent_cache"] = answer["status"]
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("file", type=Path, help="JSON prompt file, e.g. examples/benchmark_input.json")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--agent-url", help=f"preload into this running agent (default {DEFAULT_AGENT_URL})")
    where.add_argument("--model", type=Path, help="only find and report the hot experts of this expert store")
    p.add_argument("--per-layer", type=int, help="hot experts per layer (default: what the agent's cache holds "
                                                 "per layer; with --model a quarter of the experts)")
    add_token_arguments(p, "the agent's bearer token, for the preload")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    agent_url = None if args.model else (args.agent_url or DEFAULT_AGENT_URL).rstrip("/")
    try:
        if agent_url:
            check_agent_url(agent_url)
        report = warmup(args.file, agent_url, args.model, args.per_layer, token_from(args))
    except (WarmupError, TokenError) as exc:
        log.error("%s", exc)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['prompts']} prompts, {report['tokens']} tokens: {len(report['experts'])} hot experts "
              f"({report['per_layer']} per layer) cover {report['coverage']:.1%} of routing")
        if "preloaded" in report:
            print(f"preloaded {report['preloaded']} into the agent; its cache holds "
                  f"{report['agent_cache']['resident_experts']} of {report['agent_cache']['capacity_experts']} experts")
        else:
            print("hot experts [layer, expert]:", json.dumps([list(k) for k in report["experts"]]))
    return 0
