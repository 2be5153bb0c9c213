"""Wrong guesses at the agent's token, counted per client and bounded: the agent's control calls and
the dashboard's "Unlock control" form both take guesses, so both hold one GuessLimit (in memory: a
restart forgets the counts).

A client (an IP address; an IPv6 one by its /64, which one machine usually holds whole; every loopback
address is one client, this box, which can take as many of them as it likes) has FREE_GUESSES wrong
guesses. A wrong token the client already tried is no new guess (it tells the guesser nothing): a client
that repeats a wrong token it was configured with (the dashboard's FLASHMOE_TOKEN, a script) does not lock
out the others at its address. Each wrong one after those locks it out for twice as long as the last
(1 s, 2 s, 4 s, ... at most MAX_LOCK_S), and while it is locked out every guess is refused unheard,
the right one too: otherwise the lock-out would not slow the guessing. The right token clears the
client's count, and a client not wrong for FORGET_S is forgotten. So the real user, from another
address, is not locked out (unless the guesser holds more than MAX_CLIENTS addresses, below), and
from the same one (behind a proxy) for at most MAX_LOCK_S after the guessing stops. At most
MAX_CLIENTS clients are remembered; once that many are, every new client shares one entry, so many
addresses buy a guesser FREE_GUESSES each for the first MAX_CLIENTS and then one shared, locked-out
entry, never unbounded memory. This box always has an entry of its own: a guesser with many addresses
cannot push the operator's tools and the dashboard on the box into that locked-out shared entry.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

FREE_GUESSES = 5
MAX_LOCK_S = 60.0
FORGET_S = 600.0
MAX_CLIENTS = 1024
TRIED = 64                 # wrong tokens remembered per client (as keyed hashes), whose repeats are no guess
OTHERS = "other clients"   # the shared entry of the clients past MAX_CLIENTS
THIS_BOX = "this box"      # every loopback address


@dataclass
class _Client:
    wrong: int = 0
    last_wrong: float = 0.0
    locked_until: float = 0.0
    tried: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class Wrong(NamedTuple):
    """A wrong token's count: the client's wrong guesses in a row, the seconds it is now locked out for (0 while
    free guesses remain), and whether it was one the client had tried already (then nothing changed)."""
    in_a_row: int
    lock_s: float
    repeated: bool = False


def client_key(address: str | None) -> str:
    """Who guesses: the IP address, an IPv6 one by its /64; anything else (no address) as given."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address or "unknown"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return THIS_BOX
    if ip.version == 4:
        return str(ip)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


class GuessLimit:
    """Per-client wrong-token counts and lock-outs (thread-safe; `clock` in seconds, monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_CLIENTS) -> None:
        self.clock, self.max_clients = clock, max_clients
        self._clients: OrderedDict[str, _Client] = OrderedDict()   # least recently wrong first
        self._lock = threading.Lock()
        self._hash_key = secrets.token_bytes(16)   # wrong tokens are remembered hashed, never as given

    def wait_s(self, address: str | None) -> float:
        """Seconds before a guess from `address` is heard again (0: now)."""
        with self._lock:
            client = self._clients.get(self._key(client_key(address)))
            return max(0.0, client.locked_until - self.clock()) if client else 0.0

    def wrong(self, address: str | None, token: str) -> Wrong:
        """Count the wrong `token` from `address`, unless that client tried it already."""
        tried = hmac.new(self._hash_key, token.encode(errors="surrogatepass"), hashlib.sha256).digest()
        with self._lock:
            now = self.clock()
            self._forget(now)
            key = self._key(client_key(address))
            client = self._clients.get(key)
            if client is not None and tried in client.tried:
                return Wrong(client.wrong, 0.0, repeated=True)
            client = self._clients.pop(key, None) or _Client()
            self._clients[key] = client        # now the most recently wrong
            client.tried[tried] = None
            if len(client.tried) > TRIED:
                client.tried.popitem(last=False)
            client.wrong += 1
            client.last_wrong = now
            over = client.wrong - FREE_GUESSES
            lock = 0.0 if over <= 0 else min(MAX_LOCK_S, 2.0 ** min(over - 1, 32))
            client.locked_until = now + lock
            return Wrong(client.wrong, lock)

    def right(self, address: str | None) -> None:
        with self._lock:
            key = client_key(address)
            if key in self._clients:   # never the shared entry: one right token must not unlock other clients
                del self._clients[key]

    def _key(self, key: str) -> str:
        return key if key in self._clients or key == THIS_BOX or len(self._clients) < self.max_clients else OTHERS

    def _forget(self, now: float) -> None:
        while self._clients:
            key, client = next(iter(self._clients.items()))
            if now - client.last_wrong < FORGET_S:
                return
            del self._clients[key]


def lockout_message(wait_s: float) -> str:
    """What a locked-out client is told (the agent's 429, the dashboard's form)."""
    return (f"too many wrong tokens from this address: it is locked out for {math.ceil(wait_s)} s more; after "
            f"{FREE_GUESSES} wrong tokens each further one locks the address out twice as long (up to "
            f"{MAX_LOCK_S:.0f} s), and the right token clears the count")
