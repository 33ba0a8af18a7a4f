"""`python -m dtrain.plot RUN_DIR... [-o curves.png]`: loss, learning rate and throughput curves
from the `metrics.jsonl` of one or more runs, or of every job in a sweep folder, to one PNG. No W&B
needed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a file, never a window: this runs on clusters and in CI
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("input_tokens_per_s", "tokens/s (all ranks)")]


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
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def label(run: Path, root: Path) -> str:
    """The job's overrides for a sweep job (what tells the curves apart), else its folder name."""
    overrides = run / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        items = [line.removeprefix("- ").strip() for line in overrides.read_text().splitlines()]
        if items := [item for item in items if item]:
            return " ".join(items)
    return str(run.relative_to(root)) if run != root and run.is_relative_to(root) else run.name


def plot(runs: list[Path], root: Path, output: Path) -> Path:
    figure, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4), layout="constrained")
    for run in runs:
        records = read_records(run)
        train = [r for r in records if "loss" in r]
        evals = [r for r in records if "eval_loss" in r]
        name = label(run, root)
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            (line,) = ax.plot([r["step"] for r in train], [r[key] for r in train], label=name)
            if key == "loss" and evals:
                steps, losses = [r["step"] for r in evals], [r["eval_loss"] for r in evals]
                ax.plot(steps, losses, "--", color=line.get_color(), label=f"{name} (eval)")
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
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
