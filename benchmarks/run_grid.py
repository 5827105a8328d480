"""Step time and peak memory of optimizer arms on real-shaped models (GPU, bf16 everywhere).

    python benchmarks/run_grid.py --models llama-3.1-8b --cells 1x512,4x512 --rounds 2 \
        --arms adamw_fused,forge_bf16_graphed,forge_int8_graphed --liger --no-liger-ce --loss chunked \
        --recompute-swiglu --no-profile

Arms run in one process; with --rounds 2 the second round runs them in reverse order, so
drift of the card's clocks does not favour one arm. Each arm builds a fresh model, runs
``--warmup`` steps, then times ``--steps`` steps with CUDA events (median and spread),
records ``max_memory_allocated`` from the built model on (the build's own peak apart), tokens/s, and the GPU time of
the fused kernel and of all kernels per step, and the top host and GPU entries (torch
profiler over 3 extra steps). OOM is recorded as a result. Each arm and round is a row of
the results table (results_table.py); --out also writes every field as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from models import build_model
from results_table import add_table_option, append_rows
from timing import profile_steps, step_times, summary

ARMS = ["adamw_foreach", "adamw_fused", "grad_release_fused", "forge_fp32", "forge_bf16", "forge_int8",
        "bnb_adamw8bit"]
# the whole step replayed as one CUDA graph (forge_hf.GraphedStep; torch's fused AdamW with
# capturable=True, captured the way torch.cuda.graphs documents)
GRAPHED_ARMS = ["adamw_fused_graphed", "forge_bf16_graphed", "forge_int8_graphed"]
LR = 1e-5
PROFILE = True  # --no-profile: skip the 3 profiled steps


def _torch_adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, **kw)


class GradRelease:
    """Per-parameter gradient release: each parameter is stepped by its own fused AdamW as
    soon as its gradient is accumulated, and the gradient is freed at once."""

    def __init__(self, model):
        self.opts = {}
        for p in model.parameters():
            self.opts[p] = torch.optim.AdamW([p], lr=LR, weight_decay=0.01, fused=True)
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.opts[p].step()
        p.grad = None

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


class TorchGraphedStep:
    """Forward, backward and a capturable fused AdamW step, captured on the second call."""

    def __init__(self, model, opt, loss_fn):
        self.model, self.opt, self.loss_fn, self.graph = model, opt, loss_fn, None

    def __call__(self, batch):
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream
                self.loss_fn(self.model, batch).backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(side)
            self.inputs = {k: v.clone() for k, v in batch.items()}
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss_fn(self.model, self.inputs).backward()
                self.opt.step()
        for k, v in batch.items():
            self.inputs[k].copy_(v)
        self.graph.replay()


def make_optimizer(arm, model, recompute_swiglu=False):
    if arm == "adamw_fused_graphed":
        return _torch_adamw(model, fused=True, capturable=True)
    if arm == "adamw_foreach":
        return _torch_adamw(model, foreach=True)
    if arm == "adamw_fused":
        return _torch_adamw(model, fused=True)
    if arm == "grad_release_fused":
        return GradRelease(model)
    if arm.startswith("forge_"):
        import forge_hf

        forge_hf.patch_model(model, optimizer="adamw", state_precision=arm.split("_")[1], lr=LR,
                             weight_decay=0.01)
        if recompute_swiglu:
            forge_hf.recompute_swiglu(model)
        return forge_hf.ForgeOptimizer(model, lr=LR, weight_decay=0.01)
    if arm == "bnb_adamw8bit":
        import bitsandbytes as bnb  # only when its wheel is present

        return bnb.optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=0.01)
    raise ValueError(f"unknown arm {arm!r}: choose from {ARMS + GRAPHED_ARMS}")


def hf_loss(model, batch):
    return model(**batch).loss


def run_cell(model_name, arm, batch, seq, opts):
    """One arm on one (model, batch x seq) cell; ``opts``: the command line's options."""
    # cuBLAS keeps a workspace (32 MiB a handle) for each stream that ran a matmul, counted
    # as allocated: earlier arms' streams would raise this arm's peak by 64-192 MiB
    if torch.cuda.is_available():
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = dict(model=model_name, arm=arm, batch=batch, seq=seq, checkpointing=opts.checkpointing,
                  liger=opts.liger, loss=opts.loss)
    if opts.liger and opts.no_liger_ce:
        result["liger_ce"] = False
    if opts.recompute_swiglu and arm.startswith("forge_"):
        result["recompute_swiglu"] = True
    result["allocated_at_start_gib"] = torch.cuda.memory_allocated() / 2**30  # what earlier cells left
    model = opt = graphed = None
    peaks = []  # a graphed arm's peaks before its last reset of the statistics
    try:
        import forge_hf

        loss_fn = forge_hf.causal_lm_loss if opts.loss == "chunked" else hf_loss
        gib = lambda: torch.cuda.memory_allocated() / 2**30
        model = build_model(model_name, liger=opts.liger, liger_ce=not opts.no_liger_ce)
        result["params"] = sum(p.numel() for p in model.parameters())
        if opts.checkpointing:  # activations recomputed in backward: the peak is weights and states
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # initialising weights on the GPU has its own transients (fp32 temporaries of the
        # largest tensors); training's peak is counted from the built model on
        result["build_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        phases = {"model": gib()}
        opt = make_optimizer(arm, model, opts.recompute_swiglu)
        phases["optimizer"] = gib()
        gen = torch.Generator(device="cuda").manual_seed(0)
        data = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda", generator=gen)

        inputs = dict(input_ids=data, labels=data)

        def step():
            loss_fn(model, inputs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        # where the memory goes, on the first step (states are allocated lazily)
        loss = loss_fn(model, inputs)
        phases["after_forward"] = gib()
        loss.backward()
        phases["after_backward"] = gib()
        phases["peak_first_backward"] = torch.cuda.max_memory_allocated() / 2**30
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases["after_step"] = gib()
        del loss
        result["memory_phases_gib"] = phases
        if arm.endswith("_graphed"):
            graphed = (TorchGraphedStep(model, opt, loss_fn) if arm.startswith("adamw") else
                       forge_hf.GraphedStep(model, opt, loss_fn, warmup_steps=1))
            step = lambda: graphed(inputs)  # noqa: E731
            # the graphed step's own warm-up and capture: where its peak is set
            peaks = [torch.cuda.max_memory_allocated() / 2**30]  # the first eager step's
            torch.cuda.reset_peak_memory_stats()
            step()
            phases["peak_graph_warmup"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            step()
            phases["peak_capture_and_replay"] = torch.cuda.max_memory_allocated() / 2**30
            phases["after_capture"] = gib()
            torch.cuda.reset_peak_memory_stats()
            step()
            phases["peak_replay"] = torch.cuda.max_memory_allocated() / 2**30
            peaks += [phases["peak_graph_warmup"], phases["peak_capture_and_replay"]]
        for _ in range(opts.warmup - 1):
            step()
        torch.cuda.synchronize()
        timing = summary(step_times(step, opts.steps))
        result.update(status="ok", **timing, tokens_per_s=batch * seq / (timing["step_ms"] / 1e3),
                      peak_gib=max([torch.cuda.max_memory_allocated() / 2**30, *peaks]))
        if PROFILE:
            result.update(profile_steps(step))
    except torch.cuda.OutOfMemoryError:
        result.update(status="OOM", peak_gib=max([torch.cuda.max_memory_allocated() / 2**30, *peaks]))
    except (ImportError, ValueError) as e:  # no bitsandbytes wheel, or a precision not built yet
        result.update(status="unavailable", reason=f"{type(e).__name__}: {e}")
    except RuntimeError as e:  # e.g. an operation a CUDA graph cannot capture: a result too
        result.update(status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        model = opt = graphed = None  # the graphed step holds the model too: all before collecting
        gc.collect()
        torch.cuda.empty_cache()
    return result


def table_row(res: dict) -> dict:
    """The results table's row of one cell: the arm (+ckpt with activation checkpointing),
    the setup in the note; the peak without what earlier cells left allocated."""
    options = (("Liger kernels", res["liger"]), ("not its cross-entropy", res.get("liger_ce") is False),
               ("causal_lm_loss", res["loss"] == "chunked"), ("recompute_swiglu", res.get("recompute_swiglu")))
    setup = [name for name, on in options if on]
    note = ", ".join([f"round {res['round']}", *setup] + ([res["status"]] if res["status"] != "ok" else []))
    if res.get("reason"):
        note += f": {res['reason'][:200]}"
    peak = res.get("peak_gib")
    return dict(model=res["model"], batch=f"{res['batch']}x{res['seq']}",
                arm=res["arm"] + ("+ckpt" if res["checkpointing"] else ""), step_ms=res.get("step_ms"),
                spread_ms=res["step_ms_q3"] - res["step_ms_q1"] if "step_ms_q1" in res else None,
                peak_gib=None if peak is None else peak - res.get("allocated_at_start_gib", 0.0),
                tool="run_grid", note=note)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.1-8b")
    ap.add_argument("--cells", default="1x512", help="comma-separated BATCHxSEQ")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write every result's fields as JSON")
    add_table_option(ap)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every arm")
    ap.add_argument("--liger", action="store_true", help="Liger's kernels in every arm (models.apply_liger)")
    ap.add_argument("--no-liger-ce", action="store_true", help="with --liger: not its cross-entropy (graphed arms)")
    ap.add_argument("--recompute-swiglu", action="store_true", help="forge arms: forge_hf.recompute_swiglu")
    ap.add_argument("--loss", choices=["hf", "chunked"], default="hf",
                    help="every arm: the model's own loss, or forge_hf.causal_lm_loss (no fp32 logits)")
    opts = ap.parse_args()
    global PROFILE
    PROFILE = not opts.no_profile
    arms = opts.arms.split(",")
    results = []
    for model_name in opts.models.split(","):
        for cell in opts.cells.split(","):
            batch, seq = map(int, cell.split("x"))
            for r in range(opts.rounds):
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    t0 = time.time()
                    res = run_cell(model_name, arm, batch, seq, opts)
                    res.update(round=r, wall_s=time.time() - t0)
                    results.append(res)
                    print(json.dumps(res), flush=True)
                    append_rows([table_row(res)], opts.table)  # kept if a later cell dies
                    if opts.out:
                        with open(opts.out, "w") as f:
                            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
