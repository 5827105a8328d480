"""The benchmarks' one results table, ``benchmarks/results/results.csv``: one row per
measurement, only ever appended to. Every tool calls ``append_rows``; ``report.py`` reads
the table back. Rows written on another machine go to a table under $OUT (gpu.sh sets
FORGE_RESULTS_TABLE) and are merged here afterwards:

    python benchmarks/results_table.py merge path/to/results.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
from pathlib import Path

COLUMNS = ["date", "commit", "gpu", "torch", "triton", "transformers", "model", "batch", "arm",
           "step_ms", "spread_ms", "peak_gib", "tool", "note"]
TABLE = Path(__file__).resolve().parent / "results" / "results.csv"
VERSIONED = ("torch", "triton", "transformers")


def default_table() -> Path:
    return Path(os.environ.get("FORGE_RESULTS_TABLE", TABLE))


def add_table_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", type=Path, default=default_table(),
                        help="results table to append rows to (default: $FORGE_RESULTS_TABLE or %(default)s)")


def current_commit() -> str:
    """$FORGE_COMMIT when set (a copy of the working tree measured elsewhere: its .git, if it
    travelled, names the commit it was copied from, not the code that ran), else `git rev-parse
    --short HEAD` of this checkout, else 'unknown'."""
    if os.environ.get("FORGE_COMMIT"):
        return os.environ["FORGE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=TABLE.parent, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "unknown"


def environment() -> dict:
    """The columns every row of this process shares: date, commit, GPU, library versions."""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        gpu = "unknown"
    return dict(date=datetime.date.today().isoformat(), commit=current_commit(), gpu=gpu,
                **{m: _version(m) for m in VERSIONED})


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def append_rows(rows: list[dict], path: Path | str | None = None, **shared) -> Path:
    """Append ``rows`` (dicts with some of COLUMNS) to the table at ``path``; the columns a
    row leaves out come from ``shared``, then from ``environment()``."""
    path = Path(path or default_table())
    unknown = sorted({k for r in rows for k in r} - set(COLUMNS))
    if unknown:
        raise ValueError(f"columns {unknown} are not in the results table: use {COLUMNS}")
    fixed = {**environment(), **shared}
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:
            raise ValueError(f"{path} has columns {header}, not {COLUMNS}: append to a table of this layout")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell({**fixed, **row}.get(k)) for k in COLUMNS})
    return path


def read_rows(path: Path | str | None = None) -> list[dict]:
    """The table's rows in the order they were appended; numbers as floats, blanks as None."""
    with Path(path or default_table()).open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("step_ms", "spread_ms", "peak_gib"):
            row[key] = float(row[key]) if row[key] else None
    return rows


def merge(source: Path, target: Path) -> int:
    """Append ``source``'s rows to ``target``; a row without a commit takes this checkout's."""
    rows = read_rows(source)
    commit = current_commit()
    for row in rows:
        if row["commit"] in ("", "unknown"):
            row["commit"] = commit
    append_rows(rows, target)
    return len(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="append another results table's rows (e.g. one from $OUT)")
    m.add_argument("source", type=Path)
    add_table_option(m)
    opts = ap.parse_args()
    print(f"{merge(opts.source, opts.table)} row(s) appended to {opts.table}")


if __name__ == "__main__":
    main()
