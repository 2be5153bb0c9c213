"""Routing traces: the readers of every layout we accept, into one in-memory form.

Layouts (see ../shared/traces/README.md):
- decode JSONL: line 1 `{"meta": {"model", "layers", "top_k", "n_experts" (may be null), ...}}`,
  then one `{"step": s, "routed": {"0": [ids], ...}}` per token. The runtime's recorder
  (`flashmoe-cli generate --record-trace`) writes this layout too; its records may carry larger
  per-layer sets (a batched step routes the union of its tokens), an optional `"session"`
  field (a change of its value starts a new session; without it a file is one session) and an
  optional `"system": [{"layer": L, "read_latency_s": x, ...}]`: the monitoring samples the cache
  fed its policy at the start of that layer's route, which replay feeds at the same point.
- prefill NPZ: `expert_ids` [tokens, layers, k], `prompt_offsets`, `prompt_numbers`, `layers`,
  `meta` (its layers and top_k, where given, are those of expert_ids); each prompt read row by row
  is one session.

A trace is walked token by token, layer by layer, experts in stored order; `walk()` is that order
and the simulator and `access_sequence()` (Belady's future) both use it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from agent.policies.base import Key

T = TypeVar("T")


class TraceError(ValueError):
    """A trace file that cannot be read as routing; the message names the file and where."""


@dataclass(frozen=True, eq=False)
class Trace:
    name: str
    model: str
    n_layers: int
    n_experts: int
    top_k: int
    offsets: np.ndarray         # int64 [tokens * n_layers + 1]: row r = token * n_layers + layer
    experts: np.ndarray         # int32 [total]: row r's experts are experts[offsets[r]:offsets[r+1]]
    session_starts: np.ndarray  # int64 [sessions]: first token of each session; starts with 0
    layer_ids: tuple[int, ...]  # the source's own layer numbers (prefill: 1..26), for display
    # traces the runtime recorded: the monitoring samples its cache fed the policy, by the row whose
    # route they came just before (replay feeds them there)
    system: Mapping[int, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return (len(self.offsets) - 1) // self.n_layers

    @property
    def n_accesses(self) -> int:
        return len(self.experts)

    @property
    def max_set(self) -> int:
        """The largest per-layer set: the working set one step pins (top_k unless batched)."""
        return int(np.diff(self.offsets).max())

    def routed(self, token: int, layer: int) -> np.ndarray:
        r = token * self.n_layers + layer
        return self.experts[self.offsets[r]:self.offsets[r + 1]]

    def dense(self) -> np.ndarray:
        """The routing as [tokens, layers, k]; only when every set has the same size."""
        sizes = np.diff(self.offsets)
        if len(sizes) and not np.all(sizes == sizes[0]):
            raise TraceError(f"trace {self.name} has per-layer sets of different sizes "
                             f"({sizes.min()}..{sizes.max()}); use rows() instead of dense()")
        k = int(sizes[0]) if len(sizes) else self.top_k
        return self.experts.reshape(self.n_tokens, self.n_layers, k)

    def rows(self) -> list[list[int]]:
        """Every (token, layer) set as Python lists, row r = token * n_layers + layer."""
        flat, off = self.experts.tolist(), self.offsets.tolist()
        return [flat[off[r]:off[r + 1]] for r in range(len(off) - 1)]


def walk(trace: Trace) -> Iterator[tuple[bool, int, list[int]]]:
    """(new session, layer, experts) per (token, layer) step, in replay order."""
    rows, starts = trace.rows(), set(trace.session_starts.tolist())
    layers = trace.n_layers
    for token in range(trace.n_tokens):
        new = token in starts
        for layer in range(layers):
            yield new and layer == 0, layer, rows[token * layers + layer]


def access_sequence(trace: Trace) -> np.ndarray:
    """Every demand access as [N, 2] (layer, expert), in the order walk() replays them."""
    sizes = np.diff(trace.offsets)
    layer_of_row = np.tile(np.arange(trace.n_layers, dtype=np.int32), trace.n_tokens)
    return np.stack([np.repeat(layer_of_row, sizes), trace.experts], axis=1)


def session_ends(trace: Trace) -> np.ndarray:
    """Per access (in access_sequence() order), the position of the first access after its session."""
    ends = np.append(trace.session_starts[1:], trace.n_tokens)
    token = np.arange(trace.n_tokens)
    end_of_token = trace.offsets[ends[np.searchsorted(trace.session_starts, token, side="right") - 1] * trace.n_layers]
    return np.repeat(np.repeat(end_of_token, trace.n_layers), np.diff(trace.offsets))


def keys(accesses: np.ndarray) -> list[Key]:
    """An access array as (layer, expert) tuples."""
    return list(map(tuple, accesses.tolist()))


# -- building ----------------------------------------------------------------------------------
def from_sets(sets: list[list[list[int]]], name: str = "synthetic", n_experts: int | None = None,
              top_k: int | None = None, session_starts: list[int] | None = None, model: str = "synthetic") -> Trace:
    """A trace from per-token, per-layer expert lists (sets may differ in size)."""
    if not sets or not sets[0]:
        raise TraceError(f"{name}: no routing; give at least one token with one layer")
    n_layers = len(sets[0])
    if any(len(token) != n_layers for token in sets):
        raise TraceError(f"{name}: every token must route all {n_layers} layers")
    k = top_k if top_k is not None else min(len(s) for token in sets for s in token)
    return _from_sets(name, model, sets, n_layers, k, n_experts, session_starts or [0],
                      tuple(range(n_layers)), name)


def _from_sets(name: str, model: str, sets: list[list[list[int]]], n_layers: int, top_k: int,
               n_experts: int | None, session_starts: list[int], layer_ids: tuple[int, ...],
               where: str) -> Trace:
    sizes = [len(s) for token in sets for s in token]
    flat = np.fromiter((e for token in sets for s in token for e in s), dtype=np.int64, count=sum(sizes))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return _finish(name, model, offsets, flat, n_layers, top_k, n_experts, session_starts, layer_ids, where)


def _finish(name: str, model: str, offsets: np.ndarray, flat: np.ndarray, n_layers: int, top_k: int,
            n_experts: int | None, session_starts: list[int] | np.ndarray, layer_ids: tuple[int, ...],
            where: str) -> Trace:
    if len(flat) == 0:
        raise TraceError(f"{where}: no routing records; a trace needs at least one token")
    if flat.min() < 0:
        raise TraceError(f"{where}: negative expert id {int(flat.min())}")
    needed = int(flat.max()) + 1
    if n_experts is None:
        n_experts = needed
    elif needed > n_experts:
        raise TraceError(f"{where}: expert id {needed - 1} is out of range for n_experts={n_experts}; "
                         f"pass the model's expert count (--experts) or fix the file")
    return Trace(name, model, n_layers, n_experts, top_k, offsets, flat.astype(np.int32),
                 np.asarray(session_starts, dtype=np.int64), layer_ids)


# -- decode JSONL ------------------------------------------------------------------------------
def read_jsonl(path: str | Path, n_experts: int | None = None) -> Trace:
    """Read a decode-layout JSONL trace; `n_experts` overrides (or supplies a null) meta value."""
    path = Path(path)
    lines = read_text(path).splitlines()
    meta = _meta(path, lines[0] if lines else "")
    n_layers, top_k = meta["layers"], meta["top_k"]
    expected = [str(i) for i in range(n_layers)]
    limit = n_experts if n_experts is not None else meta.get("n_experts")
    sets: list[list[list[int]]] = []
    starts: list[int] = []
    system: dict[int, dict[str, float]] = {}
    session = object()  # sentinel: the first record always opens a session
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        record = _record(path, number, line, expected)
        if not starts or record.get("session", session) != session:
            starts.append(len(sets))
            session = record.get("session", session)
        for sample in _samples(path, number, record.get("system", []), n_layers):
            system[len(sets) * n_layers + int(sample.pop("layer"))] = sample
        sets.append([_expert_set(path, number, layer, record["routed"][layer], limit) for layer in expected])
    trace = _from_sets(path.stem, meta.get("model") or "unknown", sets, n_layers, top_k, limit, starts,
                       tuple(range(n_layers)), str(path))
    return dataclasses.replace(trace, system=system) if system else trace


def _samples(path: Path, number: int, samples, n_layers: int) -> list[dict[str, float]]:
    """A record's "system" list: [{"layer": L, "read_latency_s": x, ...}], each layer at most once."""
    layers = [s.get("layer") if isinstance(s, dict) else None for s in samples] if isinstance(samples, list) else [None]
    if not all(type(layer) is int and 0 <= layer < n_layers for layer in layers) or len(set(layers)) != len(layers):
        raise TraceError(f'{path}:{number}: "system" must be a list of {{"layer": L (0..{n_layers - 1}, '
                         f'each once), "read_latency_s": x, ...}}')
    return [{"layer": s["layer"], **checked_signals(f'{path}:{number}: "system" layer {s["layer"]}',
                                                    {k: v for k, v in s.items() if k != "layer"})} for s in samples]


def checked_signals(where: str, sample: object) -> dict[str, float]:
    """A monitoring sample as a policy is fed it (agent.monitor's policy_inputs): at least one signal, each a
    finite number >= 0; a latency, a share or a rate is never negative, and NaN or infinity poisons the
    learned policy's input."""
    if not isinstance(sample, dict) or not sample or not all(map(_signal, sample.values())):
        raise TraceError(f'{where}: a monitoring sample must be {{"read_latency_s": x, "mem_pressure": y, ...}} '
                         f'with at least one value, each a finite number >= 0; got {json.dumps(sample)[:60]}')
    return {k: float(v) for k, v in sample.items()}


def _signal(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:  # an integer past 1e308 has no float
        return False


def read_text(path: Path, kind: str = "trace file") -> str:
    return _read(path, lambda p: p.read_text(encoding="utf-8"), "as UTF-8 text", kind)


def _read(path: Path, read: Callable[[Path], T], what: str, kind: str = "trace file") -> T:
    """read(path), its failures as a TraceError naming the file; `what` says how it was read."""
    try:
        return read(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such {kind}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read {what} ({e})") from None


def _meta(path: Path, line: str) -> dict:
    where = f"{path}:1"
    first = parse_json(where, line) if line.strip() else None
    if not isinstance(first, dict) or "meta" not in first:
        raise TraceError(f'{where}: the first line must be {{"meta": {{...}}}} (decode JSONL layout)')
    meta = first["meta"]
    return _checked_meta(where, meta, required=("layers", "top_k"))


MAX_EXPERTS = 2**31 - 1  # a Trace holds expert ids as int32
MAX_LAYERS = 1 << 16     # far above any model's; the JSONL reader builds a key per layer before reading a line


def _checked_meta(where: str, meta: object, required: tuple[str, ...] = ()) -> dict:
    """`meta` as the readers use it: an object whose counts (those `required` never null) are positive
    integers in range, top_k at most n_experts, and model a string or null."""
    if not isinstance(meta, dict):
        raise TraceError(f"{where}: meta must be a JSON object {{...}}, got {json.dumps(meta)[:40]}")
    for field, most in (("layers", MAX_LAYERS), ("top_k", MAX_EXPERTS), ("n_experts", MAX_EXPERTS)):
        value = meta.get(field)
        if (value is not None or field in required) and not is_count(value, most):
            nullable = "" if field in required else " or null"
            raise TraceError(f"{where}: meta.{field} must be a positive integer{nullable} (at most {most}), "
                             f"got {value!r:.40}")
    if meta.get("top_k") is not None and meta.get("n_experts") is not None and meta["top_k"] > meta["n_experts"]:
        raise TraceError(f"{where}: meta.top_k={meta['top_k']} exceeds meta.n_experts={meta['n_experts']}")
    if not isinstance(meta.get("model"), (str, type(None))):
        raise TraceError(f"{where}: meta.model must be a string or null, got {meta['model']!r:.40}")
    return meta


def is_count(value: object, most: float = math.inf) -> bool:
    """A positive JSON integer up to `most` (a boolean is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def is_decode_jsonl(path: Path) -> bool:
    """Whether `path` opens with a decode JSONL trace's meta line (nothing further is read: it may be gigabytes
    of something else)."""
    try:
        with open(path, "rb") as f:
            _meta(path, f.readline(1 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, TraceError):
        return False
    return True


def parse_json(where: str, text: str) -> object:
    """`text` as JSON; what Python's parser gives up on (nesting past its recursion limit, an integer of more
    than 4,300 digits) is a TraceError naming `where` like any other bad JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{where}: not JSON this reader takes ({type(e).__name__}: {str(e)[:80]})") from None


def _record(path: Path, number: int, line: str, expected: list[str]) -> dict:
    where = f"{path}:{number}"
    record = parse_json(where, line)
    routed = record.get("routed") if isinstance(record, dict) else None
    if not isinstance(routed, dict):
        raise TraceError(f'{where}: expected {{"step": s, "routed": {{"0": [ids], ...}}}}')
    if sorted(routed, key=lambda k: (len(k), k)) != expected:
        raise TraceError(f"{where}: routed layers {sorted(routed)} do not match meta.layers={len(expected)} "
                         f"(need keys \"0\"..\"{len(expected) - 1}\")")
    return record


def _expert_set(path: Path, number: int, layer: str, ids: object, limit: int | None) -> list[int]:
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids)):
        raise TraceError(f"{path}:{number}: layer {layer} must be a non-empty list of expert ids "
                         f"(non-negative integers), got {ids!r}")
    if len(set(ids)) != len(ids):
        raise _listed_twice(f"{path}:{number}", layer, ids)
    if limit is not None and max(ids) >= limit:
        raise TraceError(f"{path}:{number}: layer {layer} expert id {max(ids)} is out of range for "
                         f"n_experts={limit}; pass the model's expert count (--experts) or fix the file")
    return ids


def _listed_twice(where: str, layer: object, ids: list[int]) -> TraceError:
    """A set that names an expert twice: the runtime routes a token to distinct experts (both layouts)."""
    return TraceError(f"{where}: layer {layer} lists an expert twice: {ids}")


# -- prefill NPZ -------------------------------------------------------------------------------
def read_npz(path: str | Path, prompts: range | None = None, n_experts: int | None = None) -> Trace:
    """Read a prefill-layout NPZ; `prompts` selects prompt numbers (e.g. range(801, 1001))."""
    path = Path(path)
    arrays = _npz_arrays(path)
    ids, offsets, numbers = arrays["expert_ids"], arrays["prompt_offsets"], arrays["prompt_numbers"]
    # by its bounds: a range such as 1..10**11 is never listed
    chosen = (np.arange(len(numbers)) if prompts is None
              else np.nonzero((numbers >= prompts.start) & (numbers < prompts.stop))[0])
    if len(chosen) == 0:
        raise TraceError(f"{path}: no prompt numbered {prompts.start}..{prompts.stop - 1} in prompt_numbers "
                         f"(it holds {numbers.min()}..{numbers.max()})")
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in chosen])
    lengths = offsets[chosen + 1] - offsets[chosen]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sel = ids[rows]  # [tokens, layers, k]
    tokens, n_layers, k = sel.shape
    meta = arrays["meta"]
    name = path.stem if prompts is None else f"{path.stem}[{prompts.start}..{prompts.stop - 1}]"
    return _finish(name, meta.get("model") or "unknown", np.arange(0, tokens * n_layers * k + 1, k),
                   sel.reshape(-1).astype(np.int64), n_layers, k,
                   n_experts if n_experts is not None else meta.get("n_experts"), starts,
                   tuple(int(x) for x in arrays["layers"]), str(path))


def _npz_arrays(path: Path) -> dict:
    arrays = _npz_members(path)
    missing = {"expert_ids", "prompt_offsets", "prompt_numbers", "layers", "meta"} - set(arrays)
    if missing:
        raise TraceError(f"{path}: missing array(s) {sorted(missing)} (prefill NPZ layout)")
    ids, offsets, numbers = arrays["expert_ids"], arrays["prompt_offsets"], arrays["prompt_numbers"]
    if ids.ndim != 3 or ids.dtype.kind not in "ui" or 0 in ids.shape:
        raise TraceError(f"{path}: array expert_ids must be a non-empty integer [tokens, layers, k] array, "
                         f"got {ids.dtype} {ids.shape}")
    if (offsets.ndim != 1 or numbers.ndim != 1 or len(offsets) != len(numbers) + 1 or offsets[0] != 0
            or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0)):
        raise TraceError(f"{path}: array prompt_offsets must rise from 0 to {len(ids)} with one entry more "
                         f"than prompt_numbers, both 1-d (shapes {offsets.shape} and {numbers.shape})")
    if arrays["layers"].shape != (ids.shape[1],):
        raise TraceError(f"{path}: array layers has shape {arrays['layers'].shape}, expected ({ids.shape[1]},)")
    twice = np.argwhere(np.any(np.diff(np.sort(ids, axis=2), axis=2) == 0, axis=2))
    if len(twice):
        token, layer = twice[0]
        raise _listed_twice(f"{path}: expert_ids[{token}]", layer, ids[token, layer].tolist())
    meta = _checked_meta(str(path), parse_json(f"{path}: array meta", str(arrays["meta"])))
    for field, axis, what in (("layers", 1, "layers"), ("top_k", 2, "experts per set (k)")):
        if meta.get(field) not in (None, ids.shape[axis]):   # the array is the routing, not what meta says
            raise TraceError(f"{path}: meta.{field}={meta[field]} but array expert_ids [tokens, layers, k] has "
                             f"{ids.shape[axis]} {what} (shape {ids.shape})")
    arrays["meta"] = meta
    return arrays


ZIP_MAGIC = b"PK\x03\x04"  # an NPZ is a zip archive of .npy members; np.load takes anything else for a pickle
# what numpy and zipfile raise on a damaged archive: cut short, a bad central directory, a member whose
# compressed data or CRC is wrong, or whose .npy header is not one
DAMAGED_NPZ = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def _head(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(len(ZIP_MAGIC))


def _npz_members(path: Path) -> dict[str, np.ndarray]:
    """Every array of the archive at `path`, read whole: a damaged member fails here, not mid-replay."""
    head = _read(path, _head, "as an NPZ archive")
    if head != ZIP_MAGIC:
        raise TraceError(f"{path}: not an NPZ archive: " + ("the file is empty" if not head else
                                                           "it does not begin as a zip archive does"))
    try:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except DAMAGED_NPZ as e:
        raise TraceError(f"{path}: not a readable NPZ archive, it is damaged or cut short "
                         f"({type(e).__name__}: {e})") from None


# -- any layout --------------------------------------------------------------------------------
def parse_prompts(text: str) -> range:
    """'801..1000' -> range(801, 1001) (inclusive, as prompts are numbered)."""
    try:
        a, b = (int(x) for x in text.split(".."))
    except ValueError:
        raise TraceError(f"prompt range {text!r} must look like A..B, e.g. 801..1000") from None
    if a > b:
        raise TraceError(f"prompt range {text!r} is empty: A must not exceed B")
    return range(a, b + 1)


def load(path: str | Path, n_experts: int | None = None, prompts: range | None = None) -> Trace:
    """Read any accepted layout by its suffix (.jsonl or .npz)."""
    path = Path(path)
    if path.suffix == ".npz":
        return read_npz(path, prompts, n_experts)
    if path.suffix == ".jsonl":
        if prompts is not None:
            raise TraceError(f"{path}: a prompt range applies to prefill NPZ traces only")
        return read_jsonl(path, n_experts)
    if not path.exists():   # a missing file is that first, whatever its name
        raise TraceError(f"{path}: no such trace file")
    raise TraceError(f"{path}: unknown trace layout; expected a .jsonl (decode) or .npz (prefill) file")
