"""Markdown table and plot from run_grid.py's JSON files.

    python benchmarks/report.py benchmarks/results/grid.json   # writes grid.md and grid.png beside it
    python benchmarks/report.py --out results/h200 a.json b.json  # several runs in one table
"""

import argparse

import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def summarize(results):
    """One row per (model, cell, arm): medians over rounds."""
    groups = defaultdict(list)
    for r in results:
        arm = (r["arm"] + (" +checkpointing" if r.get("checkpointing") else "")
               + (" +liger" if r.get("liger") else "") + (" (no liger CE)" if r.get("liger_ce") is False else "")
               + (" +swiglu recompute" if r.get("recompute_swiglu") else "")
               + (" +chunked loss" if r.get("loss") == "chunked" else ""))
        groups[(r["model"], f'{r["batch"]}x{r["seq"]}', arm)].append(r)
    rows = []
    for (model, cell, arm), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = dict(model=model, cell=cell, arm=arm, status=rs[0]["status"] if not ok else "ok")
        if ok:
            for key in ("step_ms", "peak_gib", "tokens_per_s", "fused_kernel_ms"):
                vals = [_own(r, key) for r in ok if key in r]
                if vals:
                    row[key] = statistics.median(vals)
            row["spread_ms"] = max(r["step_ms_q3"] - r["step_ms_q1"] for r in ok)
        rows.append(row)
    return rows


def _own(result, key):
    """A cell's value; its peak without what earlier cells in the process left allocated
    (run_grid.py records that as allocated_at_start_gib)."""
    if key == "peak_gib":
        return result[key] - result.get("allocated_at_start_gib", 0.0)
    return result[key]


def markdown(rows):
    lines = ["| model | batch x seq | arm | step ms (IQR) | peak GiB | tokens/s | fused kernel ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f'| {r["model"]} | {r["cell"]} | {r["arm"]} | {r["status"]} | | | |')
            continue
        kernel = f'{r["fused_kernel_ms"]:.1f}' if "fused_kernel_ms" in r else ""
        lines.append(f'| {r["model"]} | {r["cell"]} | {r["arm"]} | {r["step_ms"]:.1f} ({r["spread_ms"]:.1f}) '
                     f'| {r["peak_gib"]:.2f} | {r["tokens_per_s"]:.0f} | {kernel} |')
    return "\n".join(lines) + "\n"


SHORT = [(" (no liger CE)", "-noCE"), (" +swiglu recompute", " +swiglu"), (" +chunked loss", " +lossC"),
         (" +checkpointing", " +ckpt")]


def short(arm: str) -> str:
    """The arm's label, its options abbreviated for the plot's axis (the table keeps them whole)."""
    for long, abbreviation in SHORT:
        arm = arm.replace(long, abbreviation)
    return arm


def plot(rows, path):
    ok = [r for r in rows if r["status"] == "ok"]
    keys = sorted({(r["model"], r["cell"]) for r in ok})
    sizes = [sum((r["model"], r["cell"]) == key for r in ok) for key in keys]
    fig, axes = plt.subplots(len(keys), 2, figsize=(14, 1.2 + 0.32 * sum(sizes) + 0.8 * len(keys)), squeeze=False,
                             gridspec_kw=dict(height_ratios=[n + 2 for n in sizes]))
    for i, key in enumerate(keys):
        sel = [r for r in ok if (r["model"], r["cell"]) == key]
        names = [short(r["arm"]) for r in sel]
        for j, (metric, label) in enumerate((("step_ms", "step time (ms)"), ("peak_gib", "peak memory (GiB)"))):
            ax = axes[i][j]
            ax.barh(names, [r[metric] for r in sel], color=["tab:red" if n.startswith("forge") else "tab:gray" for n in names])
            ax.tick_params(axis="y", labelsize=8)
            ax.set_xlabel(label)
            ax.set_title(f"{key[0]}, batch x seq {key[1]}")
    fig.text(0.01, 0.002, "-noCE: Liger without its cross-entropy; +swiglu: recompute_swiglu; +lossC: forge_hf."
             "causal_lm_loss; +ckpt: activation checkpointing", fontsize=8)
    fig.tight_layout(rect=(0, 0.01, 1, 1))
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", default=None, help="path stem of the .md and .png (default: the first JSON's)")
    opts = ap.parse_args()
    results = [r for p in opts.paths for r in json.loads(Path(p).read_text())["results"]]
    rows = summarize(results)
    stem = Path(opts.out) if opts.out else Path(opts.paths[0]).with_suffix("")
    stem.with_suffix(".md").write_text(markdown(rows))
    plot(rows, stem.with_suffix(".png"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
