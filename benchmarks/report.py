"""The README's performance table and plot, drawn from the results table (results_table.py).

    python benchmarks/report.py                                 # the step grid's table, to stdout
    python benchmarks/report.py --md benchmarks/results/step_time.md --png benchmarks/results/step_time.png
    python benchmarks/report.py --tool kernel_microbench        # another tool's rows ('all': every tool's)

A line of the table is the latest measurement of one (tool, model, batch, arm): the rows of
that key with the date, commit and GPU of its last row (the rounds of one run, or the runs of
one commit on one day), their median step time, its range, and their largest peak.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_table import default_table, read_rows


def latest(rows: list[dict], tool: str = "run_grid") -> list[dict]:
    """One summary per (tool, model, batch, arm) of ``tool``'s rows ('all': every tool's)."""
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        if tool in ("all", r["tool"]):
            keyed.setdefault((r["tool"], r["model"], r["batch"], r["arm"]), []).append(r)
    out = []
    for (tool_name, model, batch, arm), rs in keyed.items():
        run = [r for r in rs if (r["date"], r["commit"], r["gpu"]) == (rs[-1]["date"], rs[-1]["commit"], rs[-1]["gpu"])]
        steps = [r["step_ms"] for r in run if r["step_ms"] is not None]
        peaks = [r["peak_gib"] for r in run if r["peak_gib"] is not None]
        failed = next((s for s in ("OOM", "error", "unavailable") if any(s in r["note"] for r in run)), "n/a")
        out.append(dict(tool=tool_name, model=model, batch=batch, arm=arm, rounds=len(run),
                        step_ms=statistics.median(steps) if steps else None,
                        low_ms=min(steps, default=None), high_ms=max(steps, default=None),
                        peak_gib=max(peaks, default=None), status="ok" if steps or failed == "n/a" else failed,
                        date=run[-1]["date"], commit=run[-1]["commit"], gpu=run[-1]["gpu"]))
    return sorted(out, key=_order)


def _order(s: dict):
    batch, seq = cell_size(s["batch"])
    return s["tool"], s["model"], batch * seq, batch, s["arm"].startswith("forge"), s["arm"]


def cell_size(cell: str) -> tuple[int, int]:
    """(rows, longest row) of a cell: BATCHxLENGTH, or BATCHxMIN-MAX[/flat] (varying lengths); (0, 0) else."""
    rows, x, lengths = cell.partition("x")
    longest = lengths.split("/")[0].split("-")[-1]
    return (int(rows), int(longest)) if x and rows.isdigit() and longest.isdigit() else (0, 0)


def _number(value, digits: int) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.{digits}f}"  # host rows: fractions of a ms


def markdown(summaries: list[dict]) -> str:
    tools = len({s["tool"] for s in summaries}) > 1  # a tool column only where several are mixed
    lines = ["| " + "tool | " * tools + "model | batch x seq | arm | step ms | range ms | peak GiB | rounds | date "
             "| commit | GPU |", "| --- " * (10 + tools) + "|"]
    for s in summaries:
        step = _number(s["step_ms"], 1) if s["step_ms"] is not None else ("" if s["status"] == "ok" else s["status"])
        spread = f'{s["low_ms"]:.1f}-{s["high_ms"]:.1f}' if s["step_ms"] is not None and s["rounds"] > 1 else ""
        lines.append("| " + f'{s["tool"]} | ' * tools + f'{s["model"]} | {s["batch"]} | {s["arm"]} | {step} | {spread} '
                     f'| {_number(s["peak_gib"], 2)} | {s["rounds"]} | {s["date"]} | {s["commit"]} | {s["gpu"]} |')
    return "\n".join(lines) + "\n"


def _label(s: dict, metric: str) -> str:
    if s["status"] == "ok":
        return _number(s[metric], 1)
    return s["status"] if s[metric] is None else f'{_number(s[metric], 1)} at {s["status"]}'


def plot(summaries: list[dict]):
    """A matplotlib Figure: per (model, batch x seq), step ms and peak GiB of each arm, forge's
    arms in red. Drawn without pyplot, so it shows in no window; save it or display it."""
    from matplotlib.figure import Figure

    keys = list(dict.fromkeys((s["model"], s["batch"]) for s in summaries))
    metrics = [(m, label) for m, label in (("step_ms", "step time (ms)"), ("peak_gib", "peak memory (GiB)"))
               if any(s[m] is not None for s in summaries)]
    sizes = [sum((s["model"], s["batch"]) == key for s in summaries) for key in keys]
    fig = Figure(figsize=(6.5 * len(metrics), 1.0 + 0.3 * sum(sizes) + 0.9 * len(keys)))
    axes = fig.subplots(len(keys), len(metrics), squeeze=False, gridspec_kw=dict(height_ratios=[n + 2 for n in sizes]))
    for i, key in enumerate(keys):
        sel = [s for s in summaries if (s["model"], s["batch"]) == key]
        names = [s["arm"] for s in sel]
        for j, (metric, label) in enumerate(metrics):
            ax = axes[i][j]
            values = [s[metric] or 0 for s in sel]
            ax.barh(range(len(sel)), values, color=["tab:red" if n.startswith("forge") else "tab:gray" for n in names])
            ends = values
            if metric == "step_ms":  # the range over a run's rounds, where it has several
                ends = [s["high_ms"] or 0 for s in sel]
                for y, s in enumerate(sel):
                    if s["rounds"] > 1 and s["step_ms"] is not None:
                        ax.errorbar(s["step_ms"], y, xerr=[[s["step_ms"] - s["low_ms"]], [s["high_ms"] - s["step_ms"]]],
                                    fmt="none", ecolor="black", capsize=2, lw=0.8)
            for y, (s, end) in enumerate(zip(sel, ends)):
                ax.annotate(_label(s, metric), (end, y), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=7)
            ax.set_yticks(range(len(sel)), names)
            ax.invert_yaxis()
            ax.set_xlim(0, 1.3 * max(ends) or 1)
            ax.tick_params(axis="y", labelsize=8)
            ax.set_xlabel(label, fontsize=8)
            ax.set_title(f"{key[0]}, batch x seq {key[1]}", fontsize=9)
    gpus = ", ".join(sorted({s["gpu"] for s in summaries}))
    dates = sorted({s["date"] for s in summaries})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    fig.text(0.01, 0.003, f"{gpus}, measured {when}; error bars: the range over a run's rounds", fontsize=7)
    fig.tight_layout(rect=(0, 0.015, 1, 1))
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", type=Path, action="append", help=f"results table(s) to read (default {default_table()})")
    ap.add_argument("--tool", default="run_grid", help="whose rows: run_grid, kernel_microbench, ... or all")
    ap.add_argument("--md", type=Path, help="write the markdown table here instead of stdout")
    ap.add_argument("--png", type=Path, help="write the plot here")
    opts = ap.parse_args()
    rows = [r for table in opts.table or [default_table()] for r in read_rows(table)]
    summaries = latest(rows, opts.tool)
    if not summaries:
        raise SystemExit(f"no rows of tool {opts.tool!r} in {opts.table or [default_table()]}")
    if opts.md:
        opts.md.write_text(markdown(summaries))
    else:
        print(markdown(summaries), end="")
    if opts.png:
        plot(summaries).savefig(opts.png, dpi=110)


if __name__ == "__main__":
    main()
