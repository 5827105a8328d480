"""What a recipe run prints and leaves in output_dir next to the model.

Start: the patch report's headline (what was fused, the gradient memory never allocated);
the full table in forge_report.txt (written again at the end, with any layer that fell
back to the ordinary path while training).
End: a short summary (steps/s and tokens/s over this run's own steps when it resumed,
losses, peak memory, forge's memory against AdamW), also in forge_summary.json, and the
train and eval loss curves in loss.png.
"""

import json
import os
import resource
import time

import torch
from transformers import TrainerCallback

from ..optim.patch import PatchReport
from ..optim.patch import _size as size_text  # the patch table's byte formatting
from .data import blocks_per_step

REPORT_FILE, SUMMARY_FILE, LOSS_PLOT = "forge_report.txt", "forge_summary.json", "loss.png"


def write_patch_report(report: PatchReport, output_dir: str) -> str:
    """Write the full patch table to output_dir; return its one-line headline."""
    with open(os.path.join(output_dir, REPORT_FILE), "w") as f:
        f.write(f"{report}\n")
    return report.summary()


def memory_against_adamw(report: PatchReport, model) -> dict:
    """Bytes of the fused weights' training memory, forge against torch's AdamW: AdamW keeps
    each weight's gradient and two moments (exp_avg, exp_avg_sq) in the weight's dtype, so
    twice the gradient bytes; forge never allocates the gradient, and its states are
    measured (8-bit codes and their scales included). Layers that fell back to the
    ordinary path while training are left out."""
    report.update_fallbacks(model)
    gradients = report.gradient_bytes_saved
    adamw_states = 2 * gradients
    modules = dict(model.named_modules())
    forge_states = sum(modules[m.name].forge_state.nbytes() for m in report.fused)
    return {"forge_gradient_bytes_never_allocated": gradients, "adamw_state_bytes": adamw_states,
            "forge_state_bytes": forge_states, "forge_bytes_saved_vs_adamw": gradients + adamw_states - forge_states}


def plot_losses(log_history: list[dict], path: str) -> bool:
    """Train and eval loss against the step; False when no loss was logged."""
    from matplotlib.figure import Figure  # not pyplot: a run leaves the caller's backend alone (png: Agg)

    curves = {"train": [(e["step"], e["loss"]) for e in log_history if "loss" in e],
              "eval": [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]}
    if not any(curves.values()):
        return False
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.subplots()
    for label, points in curves.items():
        if points:
            axes.plot(*zip(*points), "o-" if label == "eval" else "-", label=label)
    axes.set(xlabel="step", ylabel="loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)
    return True


def peak_memory() -> dict:
    peak = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return peak


class RunClock(TrainerCallback):
    """Where this run starts (not step 0 when resuming) and when its first step ends: the
    throughput after it leaves out one-off costs such as kernel compilation."""

    start_step, first_step_end, train_end = 0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step_end is None:
            self.first_step_end = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = time.perf_counter()


def summarize(recipe, trainer, clock: RunClock, train_seconds: float, wall_seconds: float) -> dict:
    args = recipe.training
    steps = trainer.state.global_step
    # every step trains the same number of full blocks (data.py), so tokens are exact
    tokens_per_step = blocks_per_step(args) * recipe.data.block_size
    run_steps = steps - clock.start_step
    later_seconds = clock.train_end - clock.first_step_end if run_steps > 1 else None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {
        "recipe": str(recipe.path), "output_dir": args.output_dir, "processes": args.world_size,
        "resumed_from": args.resume_from_checkpoint, "steps_this_run": run_steps,
        "steps": steps, "tokens_this_run": run_steps * tokens_per_step, "tokens": steps * tokens_per_step,
        "train_seconds": train_seconds, "wall_seconds": wall_seconds,
        # the rates are this run's: its steps and tokens over its time, not counting those before a resume
        "steps_per_second": run_steps / train_seconds,
        "steps_per_second_after_first_step": (run_steps - 1) / later_seconds if later_seconds else None,
        "tokens_per_second": run_steps * tokens_per_step / train_seconds,
        "tokens_per_second_after_first_step": (run_steps - 1) * tokens_per_step / later_seconds
        if later_seconds else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "last_eval_loss": evals[-1] if evals else None, **peak_memory(),
        **memory_against_adamw(trainer.forge_report, trainer.model),
    }


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _rate(summary: dict, key: str, unit: str) -> str:
    later = summary[f"{key}_after_first_step"]
    return f"{summary[key]:,.1f} {unit}" + ("" if later is None else f"; {later:,.1f} after the first step")


def print_summary(summary: dict) -> None:
    memory = f"host peak RSS {summary['host_peak_rss_gib']:.2f} GiB"
    if "cuda_peak_allocated_gib" in summary:
        memory = (f"GPU peak {summary['cuda_peak_allocated_gib']:.2f} GiB allocated "
                  f"({summary['cuda_peak_reserved_gib']:.2f} GiB reserved), {memory}")
    steps, tokens = f"{summary['steps']}", f"{summary['tokens']:,}"
    if summary["resumed_from"]:  # the totals, then this run's share, which the rates are over
        steps += f", {summary['steps_this_run']} after resuming from {summary['resumed_from']}"
        tokens += f", {summary['tokens_this_run']:,} after resuming"
    lines = [
        f"steps       {steps} ({_rate(summary, 'steps_per_second', 'steps/s')})",
        f"tokens      {tokens} ({_rate(summary, 'tokens_per_second', 'tokens/s')})",
        f"time        train {summary['train_seconds']:.1f} s, total {summary['wall_seconds']:.1f} s",
        f"loss        first {_loss(summary['first_loss'])}, last {_loss(summary['last_loss'])}, "
        f"eval {_loss(summary['last_eval_loss'])}",
        f"memory      {memory}",
        f"forge       {size_text(summary['forge_bytes_saved_vs_adamw'])} less than AdamW on the fused weights: "
        f"{size_text(summary['forge_gradient_bytes_never_allocated'])} of gradients never allocated, "
        f"states {size_text(summary['forge_state_bytes'])} against AdamW's {size_text(summary['adamw_state_bytes'])}",
        f"saved       {summary['output_dir']} (model, {', '.join(summary['files'])})",
    ]
    print("\nforge_hf.train summary (" + summary["recipe"] + ")\n  " + "\n  ".join(lines), flush=True)


def write_summary(summary: dict, log_history: list[dict]) -> None:
    """loss.png and forge_summary.json in output_dir, and the summary printed."""
    output_dir = summary["output_dir"]
    plotted = plot_losses(log_history, os.path.join(output_dir, LOSS_PLOT))
    summary["files"] = [REPORT_FILE, SUMMARY_FILE] + ([LOSS_PLOT] if plotted else [])
    with open(os.path.join(output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    print_summary(summary)
