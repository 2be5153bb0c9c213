"""Which routing traces train, which choose settings, and which report: three parts that never overlap.

The shared traces (../shared/traces/README.md) hold four decode traces per decode model (one prompt
each) and 1000 DeepSeek-V2-Lite prefill prompts. The README's report part stays untouched; its
training part is cut in two, one prompt of each decode model and a quarter of the prefill prompts
becoming the validation part:

- train: the learned policy's weights are fitted here and nowhere else;
- validation: every setting of every policy (windowed LFU's window, the learned policy's decision
  rule and percentile, the online loop's rates) is chosen here;
- report: published hit rates only; nothing is fitted or chosen on it.

qwen_math is a period-2 repetition loop: reported on its own row, never averaged, never used to choose.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.traces import Trace, load

TRACES_DIR = Path(__file__).resolve().parents[3] / "shared" / "traces"  # ../shared/traces beside the checkout
PREFILL = "prefill/deepseek_v2_lite_puffin_0001-1000.npz"
TRAIN_PROMPTS = range(1, 601)
VALIDATION_PROMPTS = range(601, 801)
REPORT_PROMPTS = range(801, 1001)


@dataclass(frozen=True)
class Part:
    """One trace file of a split, relative to the traces directory; prompts for a prefill NPZ."""
    path: str
    prompts: range | None = None

    @property
    def architecture(self) -> str:
        """The model family the routing came from: olmoe, qwen or deepseek."""
        return Path(self.path).name.split("_")[0]

    def load(self, root: Path) -> Trace:
        return load(root / self.path, prompts=self.prompts)


SPLITS: dict[str, tuple[Part, ...]] = {
    "train": (Part("decode/olmoe_prose.jsonl"), Part("decode/qwen_prose.jsonl"), Part(PREFILL, TRAIN_PROMPTS)),
    "validation": (Part("decode/olmoe_code.jsonl"), Part("decode/qwen_code.jsonl"), Part(PREFILL, VALIDATION_PROMPTS)),
    "report": (Part("decode/olmoe_math.jsonl"), Part("decode/olmoe_dialogue.jsonl"), Part("decode/qwen_dialogue.jsonl"),
               Part(PREFILL, REPORT_PROMPTS)),
}
DEGENERATE = Part("decode/qwen_math.jsonl")
ARCHITECTURES = ("olmoe", "qwen", "deepseek")


def split_parts(split: str, without: str | None = None) -> tuple[Part, ...]:
    """The parts of `split`, leaving out architecture `without` (to train weights that never saw it)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if without is not None and without not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {without!r}; choose one of {', '.join(ARCHITECTURES)}")
    return tuple(p for p in SPLITS[split] if p.architecture != without)
