"""`python -m dtrain.plot RUN_DIR... [-o curves.png]`: loss, learning rate and throughput curves (and
dtrain.grpo's mean reward) from the `metrics.jsonl` of one or more runs, or of every job in a sweep
folder, to one PNG. No W&B needed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a file, never a window: this runs on clusters and in CI
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("input_tokens_per_s", "tokens/s (all ranks)")]
REWARD = ("reward", "mean reward")  # dtrain.grpo's runs get this panel too


def find_runs(folders: list[Path]) -> list[Path]:
    """The run folders under `folders`: a run holds metrics.jsonl; a sweep holds runs below it."""
    runs = []
    for folder in folders:
        if not folder.is_dir():
            raise SystemExit(f"dtrain.plot: {folder}: no such folder")
        found = [folder] if (folder / "metrics.jsonl").is_file() else []
        found = found or sorted(path.parent for path in folder.rglob("metrics.jsonl"))
        if not found:
            raise SystemExit(f"dtrain.plot: {folder}: no metrics.jsonl in it or below it")
        runs += found
    return runs


def read_records(run: Path) -> list[dict]:
    """The run's records in step order, one per step and kind (train or eval): a metrics.jsonl written
    before dtrain truncated it on resume may repeat steps; the later record is the resumed run's."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    latest = {}
    for line in lines:
        if line.strip():
            record = json.loads(line)
            latest[(record["step"], "eval_loss" in record)] = record
    return [latest[key] for key in sorted(latest)]


def overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    items = [line.removeprefix("- ").strip() for line in path.read_text().splitlines()]
    return [item for item in items if item]


def labels(runs: list[Path], root: Path, width: int = 40) -> list[str]:
    """Each run's legend label: the overrides that tell it from the other runs (those all of them
    share say nothing; a run alone is named by its folder), else its folder; at most `width`
    characters."""
    lists = [overrides(run) for run in runs]
    shared = set.intersection(*map(set, lists))
    names = []
    for run, items in zip(runs, lists, strict=True):
        own = " ".join(item for item in items if item not in shared)
        folder = str(run.relative_to(root)) if run != root and run.is_relative_to(root) else run.name
        name = own or folder
        names.append(name if len(name) <= width else name[: width - 1] + "…")
    return names


def plot(runs: list[Path], root: Path, output: Path) -> Path:
    records_of = {run: read_records(run) for run in runs}
    rewarded = any(r.get("reward") is not None for records in records_of.values() for r in records)
    panels = [REWARD, *PANELS] if rewarded else PANELS
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), layout="constrained")
    for run, name in zip(runs, labels(runs, root), strict=True):
        records = records_of[run]
        train = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        for ax, (key, _) in zip(axes, panels, strict=True):
            shown = [r for r in train if r.get(key) is not None]  # reward: the steps that generated
            (line,) = ax.plot([r["step"] for r in shown], [r[key] for r in shown], label=name)
            if key == "loss" and evals:
                steps, losses = [r["step"] for r in evals], [r["eval_loss"] for r in evals]
                ax.plot(steps, losses, "--", color=line.get_color(), label=f"{name} (eval)")
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", loc="upper right")
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dtrain.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or sweep folders")
    parser.add_argument("-o", "--output", type=Path, help="the PNG (default: FIRST_FOLDER/curves.png)")
    args = parser.parse_args(argv)
    runs = find_runs(args.runs)
    output = plot(runs, args.runs[0], args.output or args.runs[0] / "curves.png")
    print(f"{output}: {len(runs)} run(s)", file=sys.stderr)


if __name__ == "__main__":
    main()
