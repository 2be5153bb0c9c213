"""Policies side by side: every setting chosen on the validation split, hit rates on the untouched report split.

    .venv/bin/python bench/policies.py [--traces ../shared/traces] [--jobs N] [--policies lru,lfu,...]
        [--chosen '{"lfu-window": {"window": 512}, ...}'] [--parts olmoe_math,deepseek] [--configs layer:0.25]
        [--no-absent] [--results NAME]

The splits are agent/learned/splits.py's: the learned policy's weights are trained on the train split
only (agent/policies/weights/), and nothing is fitted or chosen on the report split.

1. Selection, on the validation split (per-layer scope, capacity 0.25): every registered policy
   (agent.policies.policy_names(): a new policy joins with no edit here) runs with each of its
   candidate settings (SETTINGS; a policy without any runs as it is), then the learned policy
   learning online with each candidate OnlineConfig (ONLINE) on top of its chosen setting. Each
   keeps the candidate with the best mean per-trace share of the LRU->Belady gap.
2. Report, on the report split: every policy with its chosen setting, and the learned policy
   online, per layer at capacity 0.25, 0.125 and 0.5 and globally at 0.25; qwen_math (a period-2
   loop) on its own row, out of the means. Cold misses count; the cache starts empty.
3. Architectures absent from training: weights trained with one architecture left out of the
   train split (flashmoe-no-<arch>.safetensors), offline and online, on that architecture's report
   traces (per layer, capacity 0.25).

`--chosen` skips step 1 and reports with the settings a past selection chose (its JSON's
"selection"/"chosen": label -> setting; a policy it does not name runs with no options): the report
stage alone, whose results do not depend on how the settings were come by.

Every run is one simulate() call of the library the CLI uses (the online loop is the agent's, run
in-line). `--jobs N` spreads the runs over N processes; every run is deterministic and independent,
so the results do not depend on N. `--parts` and `--configs` report on some of the report traces
(names containing one of the given words; qwen_math with them only if named) and configurations,
to re-run what a change can move. JSON: bench/results/policies.json (`--results NAME`: NAME.json);
each run also goes to bench/results/policies-runs.json (NAME-runs.json) as it finishes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from agent.learned.online import OnlineConfig
from agent.learned.splits import ARCHITECTURES, DEGENERATE, SPLITS, TRACES_DIR, Part
from agent.policies import policy_names
from agent.policies.flashmoe import DEFAULT_WEIGHTS, WEIGHTS_DIR
from agent.simulator import gap_closed, simulate
from agent.traces import Trace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # the repo, so `bench` imports when run as a script
from bench.common import RESULTS_DIR, count, machine, results_name, write_results  # noqa: E402

RUNS_LOG: list[Path] = []  # where this invocation's runs so far go, rewritten as each finishes
_FINISHED: list[dict] = []

SELECT_AT = ("layer", 0.25)
CONFIGS = [("layer", 0.25), ("layer", 0.125), ("layer", 0.5), ("global", 0.25)]
LEARNED, ORACLE = "flashmoe", "belady"   # every other registered policy is a classic one
ONLINE_LABEL = "flashmoe online"
# Candidate settings per policy, chosen among on the validation split.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "lfu-window": [{"window": w} for w in (64, 128, 256, 512, 1024, 2048)],
    "flashmoe": [{"decision": "score"}] + [{"decision": "lfu", "keep_percentile": q} for q in (20, 30, 50)],
}
DEFAULT_ONLINE = OnlineConfig()
ONLINE = [DEFAULT_ONLINE, OnlineConfig(lr=1e-3, epochs=2), OnlineConfig(within_sessions=True),
          OnlineConfig(holdout=DEFAULT_ONLINE.every)]


@dataclass(frozen=True)
class Candidate:
    """A column of a table: a policy with options, or the learned policy learning online."""
    label: str
    policy: str
    options: str = "{}"                 # JSON, sorted: hashable
    online: OnlineConfig | None = None

    @staticmethod
    def of(label: str, policy: str, options: dict[str, Any], online: OnlineConfig | None = None) -> Candidate:
        return Candidate(label, policy, json.dumps(options, sort_keys=True), online)

    def setting(self) -> dict[str, Any]:
        """The options, and the online loop's settings that differ from its defaults."""
        online = {k: v for k, v in asdict(self.online).items() if v != getattr(DEFAULT_ONLINE, k)} if self.online \
            else None
        return {**json.loads(self.options), **({"online": online} if online is not None else {})}


@dataclass(frozen=True)
class Task:
    candidate: Candidate
    part: Part
    scope: str
    capacity: float


@dataclass
class Run:
    trace: str
    label: str
    setting: dict[str, Any]
    scope: str
    capacity: float
    hit_rate: float
    hits: int
    accesses: int
    seconds: float
    learner: dict | None = None   # the online learner's summary: updates, rollbacks, decisions, CPU seconds


_TRACES: dict[Part, Trace] = {}   # per worker process, loaded on first use
_ROOT: list[Path] = []


def _init(root: Path) -> None:
    _ROOT[:] = [root]


def run(task: Task) -> Run:
    if task.part not in _TRACES:
        _TRACES[task.part] = task.part.load(_ROOT[0])
    trace, c = _TRACES[task.part], task.candidate
    start = time.perf_counter()
    r = simulate(trace, c.policy, task.capacity, task.scope, online=c.online, **json.loads(c.options))
    return Run(trace.name, c.label, c.setting(), task.scope, task.capacity, r.hit_rate, r.hits, r.accesses,
               time.perf_counter() - start, r.online)


def run_all(tasks: list[Task], root: Path, jobs: int) -> dict[Task, Run]:
    """Every task: the slowest run of the target configuration first (it alone may take an hour), then the
    rest cheapest first, so that on a loaded machine the most runs are done soonest."""
    first = max(tasks, key=lambda t: cost(t) if (t.scope, t.capacity) == SELECT_AT else 0)
    order = [first] + sorted((t for t in tasks if t is not first), key=cost)
    if jobs <= 1:
        _init(root)
        return {t: _done(t, run(t), i, len(order)) for i, t in enumerate(order, 1)}
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(root,)) as pool:
        futures = {pool.submit(run, t): t for t in order}
        done = {futures[f]: _done(futures[f], f.result(), i, len(order))
                for i, f in enumerate(as_completed(futures), 1)}
    return {t: done[t] for t in order}


def cost(task: Task) -> int:
    """A rough relative CPU cost: learning online ~100 replays, a prefill part ~40 decode traces, global scope ~4x."""
    return ((100 if task.candidate.online else 1) * (40 if task.part.prompts else 1)
            * (4 if task.scope == "global" else 1))


def _done(task: Task, result: Run, i: int, n: int) -> Run:
    """Say that a run finished and add it to RUNS_LOG (the report stage takes hours on a loaded machine)."""
    print(f"[{i}/{n}] {result.trace} {task.candidate.label} {task.scope} {task.capacity:g}: "
          f"{result.hit_rate:.4f} in {result.seconds:.0f} s", file=sys.stderr, flush=True)
    _FINISHED.append(vars(result))
    RUNS_LOG[0].write_text(json.dumps({"runs": _FINISHED}, indent=1) + "\n")
    return result


def tasks_for(candidates: list[Candidate], parts: tuple[Part, ...], configs: list[tuple[str, float]]) -> list[Task]:
    return [Task(c, p, scope, capacity) for scope, capacity in configs for c in candidates for p in parts]


# -- selection -------------------------------------------------------------------------------------------
def share(rate: float, lru: float, belady: float) -> float:
    return gap_closed(rate, lru, belady) or 0.0  # a trace with no gap counts as none closed


def choose(candidates: list[Candidate], runs: dict[Task, Run]) -> tuple[dict[str, Candidate], dict[str, list]]:
    """Per label, the candidate with the best mean per-trace gap share on `runs`, and every candidate's score."""
    rate = {(t.candidate, r.trace): r.hit_rate for t, r in runs.items()}
    ends = {r.trace: {} for r in runs.values()}
    for t, r in runs.items():
        if t.candidate.label in ("lru", ORACLE):
            ends[r.trace][t.candidate.label] = r.hit_rate
    scores: dict[str, list] = {}
    for c in candidates:
        rates = {trace: rate[c, trace] for trace in ends}
        mean = sum(share(v, ends[t]["lru"], ends[t][ORACLE]) for t, v in rates.items()) / len(rates)
        scores.setdefault(c.label, []).append({"setting": c.setting(), "hit_rates": rates, "mean_share": mean,
                                               "candidate": c})
    chosen = {label: max(s, key=lambda x: x["mean_share"])["candidate"] for label, s in scores.items()}
    return chosen, scores


def select(policies: list[str], traces: Path, jobs: int, online: bool) -> tuple[dict[str, Candidate], dict[str, list]]:
    """Step 1: every candidate setting on the validation split; the chosen ones and every candidate's score."""
    candidates = [Candidate.of(p, p, o) for p in policies for o in SETTINGS.get(p, [{}])]
    runs = run_all(tasks_for(candidates, SPLITS["validation"], [SELECT_AT]), traces, jobs)
    chosen, scores = choose(candidates, runs)
    if online and LEARNED in chosen:
        base = json.loads(chosen[LEARNED].options)
        learning = [Candidate.of(ONLINE_LABEL, LEARNED, base, c) for c in ONLINE]
        runs |= run_all(tasks_for(learning, SPLITS["validation"], [SELECT_AT]), traces, jobs)
        more, more_scores = choose(candidates + learning, runs)
        chosen[ONLINE_LABEL], scores[ONLINE_LABEL] = more[ONLINE_LABEL], more_scores[ONLINE_LABEL]
    return chosen, scores


def selection_table(scores: dict[str, list], chosen: dict[str, Candidate]) -> str:
    lines = []
    for label, scored in scores.items():
        for s in scored:
            rates = "  ".join(f"{v:.4f}" for v in s["hit_rates"].values())
            mark = "  <- chosen" if s["candidate"] == chosen[label] else ""
            lines.append(f"{label:<16}{json.dumps(s['setting']):<90.90}{rates}  {s['mean_share']:7.1%}{mark}")
    return "\n".join(lines)


def given(text: str, policies: list[str], online: bool) -> dict[str, Candidate]:
    """The chosen candidates from a past selection's `{label: setting}` (JSON text, or a file holding it)."""
    path = Path(text)
    settings = json.loads(path.read_text() if path.is_file() else text)
    labels = policies + ([ONLINE_LABEL] if online and LEARNED in policies else [])
    if not isinstance(settings, dict) or set(settings) - set(labels):
        raise SystemExit(f"--chosen must map some of {labels} to their settings, got {text!r}")
    learned = settings.get(LEARNED, {})  # online runs on top of the learned policy's setting unless told
    return {label: candidate(label, settings.get(label, learned if label == ONLINE_LABEL else {})) for label in labels}


def candidate(label: str, setting: dict[str, Any]) -> Candidate:
    """The candidate whose setting() is `setting`: the inverse of Candidate.setting."""
    options = {k: v for k, v in setting.items() if k != "online"}
    if label != ONLINE_LABEL:
        return Candidate.of(label, label, options)
    known = {f.name for f in fields(OnlineConfig)}
    changed = setting.get("online", {})
    if set(changed) - known:
        raise SystemExit(f"--chosen: {ONLINE_LABEL} has no online setting {sorted(set(changed) - known)}")
    config = replace(DEFAULT_ONLINE, **{k: tuple(v) if isinstance(v, list) else v for k, v in changed.items()})
    return Candidate.of(label, LEARNED, options, config)


# -- the report tables ------------------------------------------------------------------------------------
def config_table(runs: list[Run], report: list[str], degenerate: str | None, labels: list[str]) -> tuple[str, dict]:
    rate = {(r.trace, r.label): r.hit_rate for r in runs}
    mean = {p: sum(rate[t, p] for t in report) / len(report) for p in labels}
    per_trace = {t: {p: gap_closed(rate[t, p], rate[t, "lru"], rate[t, ORACLE]) for p in labels} for t in report}
    summary = {"mean_hit_rate": mean,
               "gap_closed_of_means": {p: gap_closed(mean[p], mean["lru"], mean[ORACLE]) for p in labels},
               "gap_closed_mean_of_traces": {p: sum(share(rate[t, p], rate[t, "lru"], rate[t, ORACLE])
                                                    for t in report) / len(report) for p in labels},
               "gap_closed_per_trace": per_trace}
    classic = [p for p in labels if p not in (LEARNED, ONLINE_LABEL, ORACLE)]
    summary["lead_over_best_classic"] = {p: {t: rate[t, p] - max(rate[t, c] for c in classic) for t in report}
                                         for p in (LEARNED, ONLINE_LABEL) if p in labels}
    width = max(len(t) for t in report + [degenerate or ""]) + 16
    lines = ["trace".ljust(width) + "".join(p.rjust(16) for p in labels)]
    lines += [t.ljust(width) + "".join(f"{rate[t, p]:16.4f}" for p in labels) for t in report]
    lines.append("mean (report split)".ljust(width) + "".join(f"{mean[p]:16.4f}" for p in labels))
    for name, gaps in (("gap closed (of means)", summary["gap_closed_of_means"]),
                       ("gap closed (mean of traces)", summary["gap_closed_mean_of_traces"])):
        lines.append(name.ljust(width) + "".join(_pct(gaps[p]).rjust(16) for p in labels))
    if degenerate is not None:
        lines.append(f"{degenerate} (degenerate)".ljust(width)
                     + "".join(f"{rate[degenerate, p]:16.4f}" for p in labels))
    return "\n".join(lines), summary


def _pct(g: float | None) -> str:
    return "-" if g is None else f"{g:.1%}"


def absent_weights() -> dict[str, Path]:
    """Weights trained without one architecture, by the architecture they never saw (those shipped)."""
    return {arch: path for arch in ARCHITECTURES if (path := WEIGHTS_DIR / f"flashmoe-no-{arch}.safetensors").exists()}


def absent_candidates(chosen: dict[str, Candidate]) -> list[tuple[str, Candidate]]:
    """(architecture, candidate): the chosen learned policy, offline and online, on weights that never saw it."""
    out = []
    for arch, path in absent_weights().items():
        for label in (LEARNED, ONLINE_LABEL):
            if label in chosen:
                c = chosen[label]
                out.append((arch, Candidate.of(f"{label} without {arch}", c.policy,
                                               {**json.loads(c.options), "model_path": str(path)}, c.online)))
    return out


def absent_table(runs: dict[Task, Run], chosen: dict[str, Candidate]) -> tuple[str, list[dict]]:
    at = {(t.candidate.label, r.trace): r.hit_rate for t, r in runs.items() if (t.scope, t.capacity) == SELECT_AT}
    rows = []
    for t, r in runs.items():
        if " without " not in t.candidate.label:
            continue
        lru, belady = at["lru", r.trace], at[ORACLE, r.trace]
        best = max(v for (label, trace), v in at.items() if trace == r.trace and label in chosen
                   and label not in (LEARNED, ONLINE_LABEL, ORACLE))
        rows.append({"weights": t.candidate.label, "trace": r.trace, "hit_rate": r.hit_rate, "lru": lru,
                     "belady": belady, "gap_closed": gap_closed(r.hit_rate, lru, belady),
                     "lead_over_best_classic": r.hit_rate - best, "learner": r.learner})
    lines = [f"{'policy, weights':<34}{'trace':<46}{'lru':>8}{'hit rate':>10}{'belady':>8}{'gap':>8}{'lead':>9}"]
    lines += [f"{x['weights']:<34}{x['trace']:<46}{x['lru']:8.4f}{x['hit_rate']:10.4f}{x['belady']:8.4f}"
              f"{_pct(x['gap_closed']):>8}{x['lead_over_best_classic']:+9.4f}" for x in rows]
    return "\n".join(lines), rows


def default_policies() -> list[str]:
    names = [p for p in policy_names() if p != LEARNED or DEFAULT_WEIGHTS.exists()]
    return ["lru"] + [p for p in names if p not in ("lru", ORACLE)] + [ORACLE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=TRACES_DIR,
                        help="the shared traces directory (decode/, prefill/)")
    parser.add_argument("--policies", help="comma-separated registered policies (default: all); lru and belady "
                        "always run: they are the ends of the gap")
    parser.add_argument("--no-online", dest="online", action="store_false", help="leave the online loop out")
    parser.add_argument("--jobs", type=count, default=1, help="worker processes (default 1)")
    parser.add_argument("--chosen", metavar="JSON", help="skip the selection: report with these settings "
                        "({label: setting} as a past run's JSON records under selection/chosen; text or a file)")
    parser.add_argument("--parts", help="comma-separated words: only the report traces whose file names one "
                        "(default: all, qwen_math included)")
    parser.add_argument("--configs", help="comma-separated scope:capacity, e.g. layer:0.25 (default: all of "
                        f"{', '.join(f'{s}:{c:g}' for s, c in CONFIGS)})")
    parser.add_argument("--no-absent", dest="absent", action="store_false",
                        help="leave out step 3 (weights trained without an architecture)")
    parser.add_argument("--results", type=results_name, default="policies",
                        help="results name: bench/results/NAME.json (default %(default)s)")
    args = parser.parse_args()
    try:
        parts, configs = report_parts(args.parts), report_configs(args.configs)
    except ValueError as e:
        parser.error(str(e))
    policies = default_policies() if not args.policies else \
        ["lru", *[p for p in args.policies.split(",") if p not in ("lru", ORACLE)], ORACLE]
    try:
        chosen = given(args.chosen, policies, args.online) if args.chosen else None
    except ValueError as e:          # bad JSON or an unknown setting: one line, not a traceback
        parser.error(f"--chosen: {e}")
    started = time.perf_counter()
    RUNS_LOG[:] = [RESULTS_DIR / f"{args.results}-runs.json"]
    RUNS_LOG[0].unlink(missing_ok=True)  # only once the arguments are good: a typo must not lose the last log
    if chosen is not None:
        scores = {}
    else:
        chosen, scores = select(policies, args.traces, args.jobs, args.online)
        print(f"== selection: validation split, {SELECT_AT[0]} scope, capacity {SELECT_AT[1]:g}; "
              f"hit rates per trace, mean share of the gap ==\n{selection_table(scores, chosen)}")

    labels = ["lru", *[p for p in chosen if p not in ("lru", LEARNED, ONLINE_LABEL, ORACLE)],
              *[p for p in (LEARNED, ONLINE_LABEL) if p in chosen], ORACLE]
    tasks = tasks_for(list(chosen.values()), parts, configs)
    absent = absent_candidates(chosen) if args.absent and SELECT_AT in configs else []
    tasks += [Task(c, p, *SELECT_AT) for arch, c in absent for p in parts if p.architecture == arch]
    report = run_all(tasks, args.traces, args.jobs)
    names = {t.part: r.trace for t, r in report.items()}
    report_names = [names[p] for p in parts if p != DEGENERATE]
    degenerate = names.get(DEGENERATE)
    doc = {"machine": machine(), "jobs": args.jobs, "cold_misses_counted": True,
           "splits": {s: [asdict(p) | {"prompts": _range(p.prompts)} for p in parts] for s, parts in SPLITS.items()},
           "selection": {"at": SELECT_AT, "given": bool(args.chosen),
                         "scores": {label: [{k: v for k, v in s.items() if k != "candidate"}
                                                             for s in scored] for label, scored in scores.items()},
                         "chosen": {label: c.setting() for label, c in chosen.items()}},
           "report_traces": report_names, "degenerate_trace": degenerate, "configs": []}
    for scope, capacity in configs:
        config_runs = [report[Task(chosen[label], p, scope, capacity)] for label in labels for p in parts]
        table, summary = config_table(config_runs, report_names, degenerate, labels)
        print(f"\n== report split, {scope} scope, capacity {capacity:g} of experts, cold misses counted ==\n{table}")
        doc["configs"].append({"scope": scope, "capacity": capacity, **summary, "runs": [vars(r) for r in config_runs]})
    heading = f"\n== architectures absent from training: {SELECT_AT[0]} scope, capacity {SELECT_AT[1]:g} =="
    if absent:
        table, doc["absent_architectures"] = absent_table(report, chosen)
        print(f"{heading}\n{table}")
    else:  # an empty table would read as "nothing to report"
        doc["absent_architectures"] = None
        why = "--no-absent" if not args.absent else f"{SELECT_AT[0]}:{SELECT_AT[1]:g} is not among --configs"
        print(f"{heading}\nnot run: {why}")
    doc["wall_seconds"] = time.perf_counter() - started
    write_results(args.results, doc)


def report_parts(words: str | None) -> tuple[Part, ...]:
    """The report traces (and qwen_math) whose file name holds one of the comma-separated `words`; all without."""
    every = SPLITS["report"] + (DEGENERATE,)
    if not words:
        return every
    wanted = [w.strip() for w in words.split(",") if w.strip()]
    parts = tuple(p for p in every if any(w in Path(p.path).name for w in wanted))
    if not any(p in SPLITS["report"] for p in parts):
        raise ValueError(f"--parts {words!r} names no report trace; they are "
                         f"{', '.join(Path(p.path).name for p in every)}")
    return parts


def report_configs(text: str | None) -> list[tuple[str, float]]:
    """`scope:capacity,...` among CONFIGS; all of them without."""
    if not text:
        return CONFIGS
    try:
        configs = [(scope, float(capacity)) for scope, capacity in (c.split(":") for c in text.split(","))]
    except ValueError:
        raise ValueError(f"--configs {text!r} must look like layer:0.25,global:0.25") from None
    if not configs or set(configs) - set(CONFIGS):
        raise ValueError(f"--configs {text!r}: choose among {', '.join(f'{s}:{c:g}' for s, c in CONFIGS)}")
    return configs


def _range(r: range | None) -> str | None:
    return None if r is None else f"{r.start}..{r.stop - 1}"


if __name__ == "__main__":
    main()
