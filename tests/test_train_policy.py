"""train-policy on a tiny real trace slice: the weights load, are reproducible, and change decisions;
the train / validation / report splits never overlap."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.cli import main
from agents import fill
from agent.learned.model import RetentionNet, load, save, training_info
from agent.learned.splits import REPORT_PROMPTS, SPLITS, TRAIN_PROMPTS, Part
from agent.learned.train import Decisions, collect, fit, pairwise_loss, spread_sessions, train_policy
from agent.policies import policy_factory
from agent.residency import Residency
from agent.simulator import capacity_slots
from agent.traces import load as load_trace, walk

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory) -> Path:
    """The first 96 tokens of a real OLMoE decode trace."""
    path = tmp_path_factory.mktemp("traces") / "olmoe_prose_96.jsonl"
    lines = (TRACES / "olmoe_prose.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines[:97]) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny_trace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    out.with_name(out.name + ".tmp").write_text(NOTES)   # the user's, as a temporary file could be named
    assert main(["train-policy", "--trace", str(tiny_trace), "--out", str(out), "--epochs", "2",
                 "--seed", "3", "--max-decisions", "300"]) == 0
    return out


NOTES = "a file of the user's\n"


def test_training_writes_its_weights_alone_beside_a_file_named_like_its_temporary_one(trained):
    """The weights were written to NAME.tmp and renamed: a file of that name was overwritten, then gone."""
    assert sorted(p.name for p in trained.parent.iterdir()) == [trained.name, trained.name + ".tmp"]
    assert trained.with_name(trained.name + ".tmp").read_text() == NOTES


def victims(weights: Path, trace_path: Path) -> list:
    trace = load_trace(trace_path)
    cache = Residency(16 * trace.n_layers, trace.n_layers,
                      policy_factory("flashmoe", model_path=weights, recompute_threshold=0.0), "layer", trace.max_set)
    out = []
    for _, layer, experts in walk(trace):
        cache.route(layer, experts)
        out += [v for e in experts if (v := cache.access((layer, e))[1]) is not None]
    return out


def test_training_writes_weights_that_load_and_record_how(trained, tiny_trace):
    net = load(trained)
    assert isinstance(net, RetentionNet)
    info = training_info(trained)
    assert info["traces"] == ["olmoe_prose_96"] and info["seed"] == 3 and info["decisions"] > 100
    assert 0.0 <= info["victim_agreement_train"] <= 1.0


def test_trained_weights_change_decisions_against_an_untrained_model(trained, tiny_trace, tmp_path):
    torch.manual_seed(0)
    untrained = tmp_path / "untrained.safetensors"
    save(RetentionNet(), untrained, {})
    assert victims(trained, tiny_trace) != victims(untrained, tiny_trace)


def test_same_seed_gives_the_same_weights(trained, tiny_trace, tmp_path):
    again = tmp_path / "again.safetensors"
    train_policy([Part(str(tiny_trace))], again, epochs=2, seed=3, max_decisions=300)
    a, b = load(trained).state_dict(), load(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_recorded_distances_are_belady_futures(tiny_trace):
    trace = load_trace(tiny_trace)
    data = collect(trace, capacity_slots(trace, 0.25, "layer"), "belady", 300, np.random.default_rng(0))
    assert len(data) > 50
    assert (data.distance[data.mask] > 0).all()          # every candidate's next use lies ahead
    assert data.mask.sum(1).min() >= 1 and not data.distance[~data.mask].any()


def test_pairwise_loss_prefers_scores_ordered_by_next_use():
    distance = torch.tensor([[1.0, 10.0, 100.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    good = pairwise_loss(torch.tensor([[3.0, 2.0, 1.0]]), distance, mask)
    bad = pairwise_loss(torch.tensor([[1.0, 2.0, 3.0]]), distance, mask)
    assert good < bad


def test_spread_sessions_keeps_whole_sessions_in_order(tmp_path):
    lines = (TRACES / "olmoe_prose.jsonl").read_text().splitlines()
    sessions = tmp_path / "three_sessions.jsonl"  # 3 sessions of 20 tokens, as the runtime records them
    sessions.write_text("\n".join([lines[0]] + [l[:-1] + f', "session": {i // 20}}}'
                                                for i, l in enumerate(lines[1:61])]))
    trace = load_trace(sessions)
    small = spread_sessions(trace, 45)
    assert small.n_tokens == 40 and small.session_starts.tolist() == [0, 20]
    np.testing.assert_array_equal(small.dense()[:20], trace.dense()[:20])   # sessions 0 and 2, whole
    np.testing.assert_array_equal(small.dense()[20:], trace.dense()[40:])
    assert spread_sessions(trace, 60) is trace


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    assert main(["train-policy", "--trace", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "no such trace file" in capsys.readouterr().err and not out.exists()


def test_the_splits_never_overlap():
    seen: dict[str, list[range | None]] = {}
    for split, parts in SPLITS.items():
        for part in parts:
            for other in seen.get(part.path, []):
                assert part.prompts is not None and other is not None, f"{part.path} is in two splits whole"
                assert not set(part.prompts) & set(other), f"{part.path}: prompts in two splits"
            seen.setdefault(part.path, []).append(part.prompts)
    assert {p.architecture for p in SPLITS["report"]} == {"olmoe", "qwen", "deepseek"}


def test_prompts_of_a_prefill_file_default_to_the_train_split_never_the_report(tmp_path):
    numbers = np.array([1, 2, 3, 801, 802], np.int32)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, (2, 2), replace=False) for _ in range(5 * 40)]).reshape(200, 2, 2)
    npz = tmp_path / "prefill.npz"
    np.savez(npz, expert_ids=ids.astype(np.uint8), prompt_offsets=np.arange(0, 201, 40), prompt_numbers=numbers,
             layers=np.array([1, 2], np.int16), meta=json.dumps({"model": "tiny", "n_experts": 16}))
    out = tmp_path / "w.safetensors"
    assert main(["train-policy", "--trace", str(npz), "--out", str(out), "--epochs", "1", "--max-decisions", "50"]) == 0
    assert training_info(out)["traces"] == [f"prefill[{TRAIN_PROMPTS.start}..{TRAIN_PROMPTS.stop - 1}]"]
    assert 801 in REPORT_PROMPTS and 801 not in TRAIN_PROMPTS


@pytest.mark.parametrize("argv, message", [
    (["--train-split", "--prompts", "1..10"], "--prompts applies to --trace"),
    (["--trace", "x.jsonl", "--without", "qwen"], "--without applies to --train-split"),
])
def test_conflicting_options_are_clear_errors(tmp_path, capsys, argv, message):
    assert main(["train-policy", *argv, "--out", str(tmp_path / "w.safetensors")]) == 2
    assert message in capsys.readouterr().err


def test_recorded_monitoring_series_reach_the_decisions_and_the_system_tower_can_learn_from_them(tmp_path):
    lines = (TRACES / "olmoe_prose.jsonl").read_text().splitlines()[:81]
    records = [json.loads(line) for line in lines[1:]]
    for i, r in enumerate(records):  # the cache fed a sample at layer 0 every 8th step, latency rising
        if i % 8 == 0:
            r["system"] = [{"layer": 0, "read_latency_s": 1e-4 * (1 + i), "mem_pressure": 0.5}]
    path = tmp_path / "recorded.jsonl"
    path.write_text("\n".join([lines[0]] + [json.dumps(r) for r in records]))
    trace = load_trace(path)
    data = collect(trace, capacity_slots(trace, 0.25, "layer"), "belady", 200, np.random.default_rng(0))
    assert not np.isnan(data.series).any() and (data.series[:, :, 1] == 0.5).all()
    assert len(np.unique(data.series[:, -1, 0])) > 3  # the latest latency moves with the replay
    plain = collect(load_trace(TRACES / "olmoe_prose.jsonl"), 128, "belady", 50, np.random.default_rng(0))
    assert np.isnan(plain.series).all()  # no samples recorded: nothing to learn from

    # two candidates whose order of next use flips with the latency: only the recorded series tells
    rng = np.random.default_rng(1)
    n = 400
    slow = rng.random(n) < 0.5
    signature = np.zeros((n, 16, 32), np.float32)
    features = np.zeros((n, 16, 16), np.float32)
    features[:, 1, 0] = 1.0
    distance = np.zeros((n, 16), np.float32)
    distance[:, 0], distance[:, 1] = np.where(slow, 1, 50), np.where(slow, 50, 1)
    mask = np.zeros((n, 16), bool)
    mask[:, :2] = True
    series = np.zeros((n, 16, 2), np.float32)
    series[:, :, 0] = np.where(slow, 1.5, -1.0)[:, None]
    toy = Decisions(signature, features, distance, mask, series)

    def right(net) -> float:
        with torch.inference_mode():
            h = net.expert(torch.from_numpy(signature[:, :2].reshape(-1, 32)),
                           torch.from_numpy(features[:, :2].reshape(-1, 16))).view(n, 2, -1)
            scores = (h * net.system(torch.from_numpy(series))[:, None, :]).sum(-1)
        return float(((scores[:, 0] > scores[:, 1]).numpy() == slow).mean())

    assert right(fit(toy, epochs=30, seed=0, batch=64, system="recorded")) > 0.95
    assert right(fit(toy, epochs=30, seed=0, batch=64, system="random")) < 0.75


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_an_unwritable_out_fails_before_training_and_leaves_nothing(tiny_trace, tmp_path, capsys, where):
    (tmp_path / "taken").mkdir() if where == "a directory" else (tmp_path / "taken").write_text("x")
    out = tmp_path / "taken" if where == "a directory" else tmp_path / "taken" / "w.safetensors"
    assert main(["train-policy", "--trace", str(tiny_trace), "--out", str(out), "--max-decisions", "50"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the policy weights {out}" in err and "decisions" not in err  # refused before training
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no .tmp left


@pytest.mark.parametrize("content", [b"SQLite format 3\0" + bytes(100), b"precious notes\n"])
def test_an_out_that_holds_something_else_is_left_as_it_is(tiny_trace, tmp_path, capsys, content):
    """train-policy --out overwrote any file it was given (a mistyped store, the experts of a model)."""
    taken = tmp_path / "flashmoe.db"
    taken.write_bytes(content)
    assert main(["train-policy", "--trace", str(tiny_trace), "--out", str(taken), "--max-decisions", "50"]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken} exists and holds something other than the policy weights" in err
    assert "decisions" not in err and taken.read_bytes() == content  # refused before training


def test_policy_weights_are_written_over_earlier_ones(tmp_path):
    out = tmp_path / "w.safetensors"
    for epochs in (1, 2):
        save(RetentionNet(), out, {"epochs": epochs})
    assert training_info(out) == {"epochs": 2}


def test_a_full_disk_fails_before_training_and_leaves_nothing(tiny_trace, tmpfs, capsys):
    """A full disk takes the empty file the write check made: training ran, then the weights were lost."""
    disk = tmpfs("1m")
    fill(disk)
    out = disk / "w.safetensors"
    assert main(["train-policy", "--trace", str(tiny_trace), "--out", str(out), "--max-decisions", "50"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the policy weights {out}: No space left on device; pass another --out" in err
    assert "decisions" not in err and sorted(p.name for p in disk.iterdir()) == ["filler"]   # refused before training


def test_a_failed_write_check_removes_the_directories_it_made(tiny_trace, tmp_path, capsys):
    out = tmp_path / "a" / "b" / ("w" * 250 + ".safetensors")  # the directories can be made, the file not
    assert main(["train-policy", "--trace", str(tiny_trace), "--out", str(out), "--max-decisions", "50"]) == 2
    assert "File name too long" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_passed_write_check_leaves_nothing_before_training(tmp_path):
    from agent.learned.model import check_writable

    check_writable(tmp_path / "a" / "b" / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed: a seed is 0 to"), (["--seed", "1" + "0" * 30], "--seed: a seed is 0 to"),
    (["--epochs", "0"], "--epochs: must be at least 1"), (["--max-tokens", "nan"], "--max-tokens: expected a whole"),
])
def test_bad_numbers_name_their_flag(tiny_trace, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train-policy", "--trace", str(tiny_trace), "--out", str(tmp_path / "w.safetensors"), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_prompt_range_says_why(tiny_trace, tmp_path, capsys):
    assert main(["train-policy", "--trace", str(tiny_trace), "--prompts", "9..1", "--out", str(tmp_path / "w")]) == 2
    assert "'9..1' is empty: A must not exceed B" in capsys.readouterr().err


def test_ctrl_c_mid_training_is_one_line_and_leaves_no_weights(tiny_trace, tmp_path):
    """It ended in a KeyboardInterrupt traceback from inside torch."""
    out = tmp_path / "w.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "train-policy", "--trace", str(tiny_trace),
                             "--out", str(out), "--epochs", "100000"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as a terminal has it
    lines = []
    for line in proc.stderr:              # the last driver's decisions are in: training has begun
        lines.append(line)
        if "lru deciding" in line:
            break
    proc.send_signal(signal.SIGINT)
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=120) == 130, "".join(lines)
    assert "train-policy interrupted (Ctrl-C) before it finished; run it again" in lines[-1]
    assert not any("Traceback" in line for line in lines)
    assert list(tmp_path.iterdir()) == []      # neither the weights nor their .tmp
