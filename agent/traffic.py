"""flashmoe-cli traffic: a few clients sending completions to the agent, so the demo has load.

Examples:
    flashmoe-cli traffic                                   # 2 clients against http://127.0.0.1:8600, forever
    flashmoe-cli traffic --clients 4 --requests 50 --prompts examples/benchmark_input.json

Prompts come from a warm-up file (see `flashmoe-cli warmup --help` for its format). Each client
walks the prompts in its own order, so the routed experts drift as a real mix of users would make
them. It waits for the agent to come up, and rides out restarts: a refused connection, a timeout or a
5xx is logged and retried. A request the agent refuses as bad (a 4xx other than 408 and 429) would be
refused again: the command stops with the agent's answer and exit status 1. It only talks to the URL
it is given (loopback by default).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import threading
import time
from pathlib import Path

import httpx

from access.whole_answer import AnswerTooLarge, read_whole
from agent.argtypes import count
from agent.warmup import DEFAULT_AGENT_URL, WarmupError, agent_answer, answered, check_agent_url, load_prompts

log = logging.getLogger(__name__)
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "benchmark_input.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--agent-url", default=os.environ.get("FLASHMOE_AGENT_URL", DEFAULT_AGENT_URL),
                        help=f"the agent (default $FLASHMOE_AGENT_URL or {DEFAULT_AGENT_URL})")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="warm-up style prompt file")
    parser.add_argument("--clients", type=count, default=2, help="concurrent clients (default 2)")
    parser.add_argument("--requests", type=int, default=0, help="requests per client; 0 runs until stopped")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds a client waits between requests")
    parser.add_argument("--max-tokens", type=count, help="tokens per completion (default: the file's max_tokens)")


RETRIED = (408, 429)  # client errors that a later attempt can get past
ANSWER_TIMEOUT_S = 120.0   # for a whole completion: a dripping answer was waited for for ever
COMPLETION = {"choices": list, "usage": {}}   # what an agent's completion holds ({}: an object), checked in each answer


def client(url: str, prompts: list, max_tokens: int, requests: int, pause: float, seed: int,
           stop: threading.Event, refused: list[str]) -> None:
    order = random.Random(seed)
    sent = 0
    with httpx.Client(base_url=url) as http:
        while not stop.is_set() and (requests == 0 or sent < requests):
            body = {"prompt": order.choice(prompts), "max_tokens": max_tokens}
            try:
                reply = read_whole(http, "POST", "/v1/completions", ANSWER_TIMEOUT_S, json=body)
                reply.raise_for_status()
                sent += 1
                log.debug("client %d: %s", seed, agent_answer(reply, COMPLETION)["usage"])
            except (WarmupError, AnswerTooLarge) as exc:   # another service at the address: asking again won't help
                refused.append(f"{url} is not a FlashMoE agent: it answered with {exc}"
                               if isinstance(exc, AnswerTooLarge) else str(exc))
                stop.set()
                return
            except httpx.HTTPStatusError as exc:
                if 400 <= exc.response.status_code < 500 and exc.response.status_code not in RETRIED:
                    refused.append(f"the agent refused a request with {answered(exc.response)}")
                    stop.set()
                    return
                log.warning("client %d: the agent answered %s; retrying", seed, answered(exc.response))
                stop.wait(2.0)
            except httpx.HTTPError as exc:
                log.warning("client %d: %s; retrying", seed, exc)
                stop.wait(2.0)
            stop.wait(pause)


def run(args: argparse.Namespace) -> int:
    if args.requests < 0 or not 0 <= args.pause < math.inf:
        log.error("--requests must be >= 0 and --pause a finite number of seconds >= 0, got %d and %s",
                  args.requests, args.pause)
        return 2
    try:
        check_agent_url(args.agent_url)
        prompts = load_prompts(args.prompts)
    except WarmupError as exc:
        log.error("%s", exc)
        return 2
    max_tokens = args.max_tokens or prompts.max_tokens
    stop, refused = threading.Event(), []
    threads = [threading.Thread(target=client, daemon=True, name=f"client-{i}",
                                args=(args.agent_url, prompts.prompts, max_tokens, args.requests, args.pause, i, stop,
                                      refused))
               for i in range(args.clients)]
    log.info("%d clients sending completions to %s", args.clients, args.agent_url)
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
    except KeyboardInterrupt:
        stop.set()
    if refused:
        log.error("%s", refused[0])
        return 1
    return 0
