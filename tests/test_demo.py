"""flashmoe-cli init-demo: the random-weight OLMoE-shaped model, its idempotence and its routing."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import OlmoeConfig, OlmoeForCausalLM

from agent.convert.safetensors_io import read_header
from agent.convert.store_writer import StoreShape
from agent.demo import N_EXPERTS, SIZES, TOP_K, DemoError, init_demo
from agent.experts.layout import CONFIG, DENSE, EXPERTS, INDEX, Index
from agent.experts.provider import InMemoryExperts
from agent.tokenizer import HFTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "agent.cli"]
PROSE = (REPO.parent / "shared" / "DESIGN.md").read_text()[:1200] if (REPO.parent / "shared").exists() else None
CODE = inspect.getsource(read_header)[:1200]  # real code, whatever else the file holds


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return init_demo(tmp_path_factory.mktemp("d") / "demo", "small")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _stamps(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}


def test_small_demo_is_a_complete_olmoe_store(demo):
    index = Index.load(demo / INDEX)
    s = SIZES["small"]
    assert (index.n_layers, index.n_experts, index.hidden, index.intermediate, index.dtype) == (
        s.n_layers, N_EXPERTS, s.hidden, s.intermediate, "float32")
    InMemoryExperts(demo)  # every block's CRC checks out
    assert (demo / EXPERTS).stat().st_size < 8 << 20
    config = json.loads((demo / CONFIG).read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("olmoe", 64, 8)
    tok = load_tokenizer(demo)
    assert isinstance(tok, HFTokenizer) and tok.encode("hi") == [104, 105]


def test_default_size_is_one_and_a_half_gib_of_experts():
    s = SIZES["default"]
    shape = StoreShape(s.n_layers, N_EXPERTS, s.hidden, s.intermediate, "float32", 4)
    index = Index(shape.n_layers, shape.n_experts, shape.hidden, shape.intermediate, shape.dtype, shape.itemsize,
                  alignment=4096, blocks=[])
    assert index.slot_bytes == index.nbytes  # no padding wasted
    assert s.n_layers * N_EXPERTS * index.slot_bytes == 3 << 29  # 1.5 GiB


def test_reruns_write_identical_bytes(demo, tmp_path):
    again = init_demo(tmp_path / "again", "small")
    assert _files(again) == _files(demo)


def test_complete_demo_is_left_alone(demo):
    before = _stamps(demo)
    init_demo(demo, "small")
    assert _stamps(demo) == before


@pytest.mark.parametrize("damage", ["drop_index", "truncate_experts", "other_size"])
def test_partial_or_different_demo_is_rebuilt(demo, tmp_path, damage):
    out = init_demo(tmp_path / "demo", "small")
    if damage == "drop_index":
        (out / INDEX).unlink()
    elif damage == "truncate_experts":
        os.truncate(out / EXPERTS, 4096)
    else:
        config = json.loads((out / CONFIG).read_text())
        config["flashmoe_demo"]["size"] = "default"
        (out / CONFIG).write_text(json.dumps(config))
    (tmp_path / ".demo.partial-left-by-a-crash").mkdir()
    init_demo(out, "small")
    assert _files(out) == _files(demo)
    assert not list(tmp_path.glob(".demo.*"))


def test_refuses_to_replace_a_directory_that_is_not_a_demo(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "olmoe"}')
    with pytest.raises(DemoError, match="does not hold a FlashMoE demo"):
        init_demo(out, "small")
    assert (out / "config.json").read_text() == '{"model_type": "olmoe"}'


# ---------------------------------------------------------------- transformers as the reference OLMoE

@pytest.fixture(scope="module")
def hf_demo(demo) -> OlmoeForCausalLM:
    """The demo loaded into transformers' OLMoE: strict loading proves the tensor names and shapes."""
    model = OlmoeForCausalLM(OlmoeConfig.from_pretrained(demo)).eval()
    state = load_file(demo / DENSE)
    experts = InMemoryExperts(demo)
    for layer in range(model.config.num_hidden_layers):
        blocks = [experts.get(layer, e) for e in range(N_EXPERTS)]
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([b.gate, b.up])
                                                                               for b in blocks])
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([b.down for b in blocks])
    model.load_state_dict(state, strict=True)
    return model


def _routes(model: OlmoeForCausalLM, text: str) -> list[np.ndarray]:
    """Per layer, [tokens, 8] expert ids chosen for each byte of `text`."""
    with torch.no_grad():
        out = model(torch.tensor([list(text.encode())]), output_router_logits=True)
    assert torch.isfinite(out.logits).all()
    return [torch.topk(r, TOP_K, dim=-1).indices.numpy() for r in out.router_logits]


def _popularity(sel: np.ndarray) -> np.ndarray:
    return np.bincount(sel.ravel(), minlength=N_EXPERTS) / sel.size


def test_routing_is_long_tailed_and_context_dependent(hf_demo):
    for sel in _routes(hf_demo, CODE):
        top_fifth = np.sort(_popularity(sel))[::-1][:N_EXPERTS // 5].sum()
        assert top_fifth > 0.4  # uniform routing gives ~0.25 here
        # a router that saw only the current byte could pick at most one set per distinct byte
        assert len({tuple(sorted(r)) for r in sel}) > 2 * len(set(CODE.encode()))


@pytest.mark.skipif(PROSE is None, reason="../shared is absent")
def test_hot_experts_shift_between_prose_and_code(hf_demo):
    for prose, code in zip(_routes(hf_demo, PROSE), _routes(hf_demo, CODE)):
        tv = 0.5 * np.abs(_popularity(prose) - _popularity(code)).sum()
        halves = 0.5 * np.abs(_popularity(code[:len(code) // 2]) - _popularity(code[len(code) // 2:])).sum()
        assert tv > 0.08 and tv > halves / 2, (tv, halves)


def test_greedy_text_is_printable(hf_demo):
    with torch.no_grad():
        ids = hf_demo.generate(torch.tensor([list(b"Once upon")]), max_new_tokens=24, do_sample=False)[0, 9:]
    assert all(32 <= t < 127 or t == 10 for t in ids.tolist()), ids  # printable ASCII or newline


def test_our_model_runs_the_demo_like_transformers(demo, hf_demo):
    from agent.model.loading import load_model
    ids = list(b"def f(x): return x")
    model = load_model(demo, InMemoryExperts(demo))
    ours = model.step([(model.new_sequence(len(ids)), torch.tensor(ids))], all_logits=True)[0]
    with torch.no_grad():
        ref = hf_demo(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the command line and the runtime

def test_cli_init_demo_then_generate(tmp_path):
    out = tmp_path / "demo"
    made = subprocess.run(CLI + ["init-demo", "--out", str(out), "--size", "small"], cwd=REPO,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    gen = subprocess.run(CLI + ["generate", "--model", str(out), "--prompt", "hello", "--max-new-tokens", "6",
                                "--greedy", "--json"], cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert len(result["token_ids"]) == 6 and all(32 <= t < 127 or t == 10 for t in result["token_ids"])
    assert result["text"] == bytes(result["token_ids"]).decode()


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_init_demo_onto_a_disk_without_room_fails_at_once_and_writes_nothing(tmpfs):
    """It ended in a bare "[Errno 28] No space left on device" where convert says what it needs."""
    disk = tmpfs("2m")
    out = disk / "models" / "demo"
    proc = subprocess.run(CLI + ["init-demo", "--out", str(out), "--size", "small"], cwd=REPO, capture_output=True,
                          text=True)
    line = _one_error_line(proc)
    assert f"init-demo failed: the store needs 3.4 MB and the disk of {out} has 2.1 MB free; " in line
    assert line.endswith("free space there or choose another --out") and list(disk.iterdir()) == []


_FILL_SCRIPT = """
import sys
from pathlib import Path
import agent.demo
from agent.cli import main
from agents import fill
block, blocks = agent.demo._expert_block, []
def fill_midway(*args):  # as another writer on the disk would, once the start has found room
    blocks.append(1)
    if len(blocks) == 64:
        fill(Path(sys.argv[1]).parents[1])
    block(*args)
agent.demo._expert_block = fill_midway
sys.exit(main(["init-demo", "--out", sys.argv[1], "--size", "small"]))
"""


def test_a_disk_that_fills_midway_ends_init_demo_in_one_line_and_leaves_nothing(tmpfs, demo):
    """The start finds room; another writer takes it midway: a real ENOSPC from the kernel, not a mock."""
    disk = tmpfs("8m")
    out = disk / "models" / "demo"
    proc = subprocess.run([sys.executable, "-c", _FILL_SCRIPT, str(out)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    line = _one_error_line(proc)
    assert line.endswith(f"init-demo failed: the disk of {out} filled up while writing (No space left on device); "
                         f"nothing was written to {out}: free space there or choose another --out")
    assert [p.name for p in disk.iterdir()] == ["filler"]     # no demo, no partial directory, no models/
    (disk / "filler").unlink()
    again = subprocess.run(CLI + ["init-demo", "--out", str(out), "--size", "small"], cwd=REPO, capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    assert _files(out) == _files(demo)


def _tree(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("enclosing, inside", [("store", "inner"), ("store", "a/b"), ("checkpoint", "demo")])
def test_init_demo_inside_another_model_is_refused_naming_it(tmp_path, enclosing, inside):
    """A demo written inside another model went with it when that model was replaced: rebuilding an older demo
    removed the one nested in it, unsaid. A model is config.json beside safetensors weights: an expert store
    (dense.safetensors), or a checkpoint as convert reads it."""
    model = tmp_path / "model"
    if enclosing == "store":
        init_demo(model, "small")
    else:
        model.mkdir()
        (model / CONFIG).write_text('{"model_type": "olmoe"}')
        save_file({"lm_head.weight": torch.zeros(2, 2)}, model / "model.safetensors")
    before = _tree(tmp_path)
    proc = subprocess.run(CLI + ["init-demo", "--out", str(model / inside), "--size", "small"], cwd=REPO,
                          capture_output=True, text=True)
    assert f"{model / inside} would be written inside the model {model}" in _one_error_line(proc)
    assert _tree(tmp_path) == before


def test_a_directory_holding_a_config_json_alone_is_no_model(tmp_path):
    (tmp_path / CONFIG).write_text("{}")   # a project's settings, say
    assert init_demo(tmp_path / "demo", "small") == tmp_path / "demo"


def test_cli_rejects_an_unknown_size(tmp_path):
    bad = subprocess.run(CLI + ["init-demo", "--out", str(tmp_path / "d"), "--size", "huge"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'huge'" in bad.stderr
    assert not (tmp_path / "d").exists()


def test_init_demo_into_a_symlink_writes_where_it_points(tmp_path):
    """`--out` a link to an empty directory (the demo on another disk) wrote the whole demo beside the link and
    failed renaming it onto the link: "[Errno 20] Not a directory"."""
    ssd, link = tmp_path / "ssd" / "demo", tmp_path / "demo"
    ssd.mkdir(parents=True)
    link.symlink_to(ssd)
    made = subprocess.run(CLI + ["init-demo", "--out", str(link), "--size", "small"], cwd=REPO, capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stderr
    assert link.is_symlink() and (ssd / INDEX).is_file() and sorted(os.listdir(tmp_path)) == ["demo", "ssd"]
