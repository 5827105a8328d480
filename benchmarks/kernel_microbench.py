"""GPU time of the fused kernel over a model's linear shapes, summed as the model runs them,
against its memory floor; and cuBLAS forming the same weight gradients (dY^T X), for reference;
and the two-pass path (kernels/two_pass.py: cuBLAS's fp32 gradient into a scratch buffer, then
the rule's kernel over it), which dispatch's auto mode takes where it is faster.

Floor of a shape = max(bytes the kernel must move / measured copy bandwidth, its FLOPs /
measured bf16 matmul rate); the bytes: x and dy read once, the weight and each state read
and written. Times are the GPU time of CUDA-graph replays (a training step runs graphed),
AdamW, one layer of each distinct shape at a time. One row per arm goes to the results table
(step_ms: the model sum): the fused kernel's and its floor (path fused), the two-pass path's
(two_pass), cuBLAS's bf16 dY^T X alone (cublas), and with fused and two_pass both, the sum of
what auto would pick per shape.

    python benchmarks/kernel_microbench.py --state int8                    # the persistent kernel
    python benchmarks/kernel_microbench.py --kernel triton --configs all   # tile configs, best kept
    python benchmarks/kernel_microbench.py --ablate mainloop_only          # kernel_ablations.py
    python benchmarks/kernel_microbench.py --tokens 2048 --paths fused,two_pass,cublas
    python benchmarks/kernel_microbench.py --kernel wide --tokens 4096     # 128 x 128 tiles
    ncu --kernel-name regex:update --launch-skip 3 --launch-count 1 --set full -o prof \\
        python benchmarks/kernel_microbench.py --ncu gate_proj/up_proj     # launches only, no timing
"""

import argparse
import json
from functools import partial

import torch
import triton

from forge_hf.core.config import STATE_PRECISIONS
from forge_hf.core.factored import FactoredSlot
from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels import (
    MANY_TOKENS,
    TWO_PASS_MARGIN,
    GradientScratch,
    faster_path,
    launch_fused_update,
    launch_rule_step,
    matmul_fp32,
    next_launch_args,
    weight_gradient,
)
from forge_hf.kernels.launch.persistent_launch import launch_persistent, persistent_unsupported
from forge_hf.kernels.launch.wide_launch import launch_wide, wide_unsupported
from forge_hf.kernels.triton.fused_update import RULE_UPDATES, default_config

import kernel_ablations
from models import SHAPES, linear_shapes
from results_table import add_table_option, append_rows

# (BLOCK_N, BLOCK_K, BLOCK_T, warps, stages) for --configs all: the Triton kernel's tile sweep
CONFIGS = [
    (64, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 64, 64, 8, 4), (64, 64, 128, 8, 2),
    (64, 64, 32, 8, 4), (64, 128, 64, 4, 3), (64, 128, 64, 16, 3), (128, 64, 64, 16, 3), (32, 64, 64, 4, 3),
    (32, 128, 64, 8, 3),
]


def ceilings() -> tuple[float, float]:
    """Measured HBM copy bandwidth (bytes/s) and bf16 matmul rate (FLOP/s)."""
    a = torch.empty(1024**3, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    bandwidth = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: m @ m, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms * 1e-3)


def gpu_ms(fn) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph: GPU time without the host's launch cost."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def layer(n: int, k: int, tokens: int, precision: str, seed: int = 0):
    """x, dy, weight, state slots and launch arguments of one layer three steps in, its states
    filled with small random values (8-bit codes then span their range)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-5, weight_decay=0.01))
    state = ForgeState(rule, precision, transposed=False)  # the layout a fused layer allocates
    state.allocate(w, group)
    for s in state.kernel_slots():
        if isinstance(s, torch.Tensor):
            s.copy_(torch.rand(n, k, device="cuda", generator=g) * 1e-4)
        elif isinstance(s, FactoredSlot):
            s.vectors.copy_(torch.rand(s.vectors.shape, device="cuda", generator=g) * 1e-4)
        elif s is not None:
            s.write(torch.rand(n, k, device="cuda", generator=g) * 1e-4)
    for _ in range(3):
        args = next_launch_args(rule, group, state, 1234, "cuda")
    return x, dy, w, state, args


def launcher(opts, x, dy, w, slots, args, stats, config=None):
    """The launch this run times: the persistent kernel (or an ablation of it), the wide one,
    or the Triton kernel with ``config`` (BN, BK, BT, warps, stages; None: its default)."""
    stochastic = opts.rounding == "stochastic"
    if opts.kernel == "wide":
        reason = wide_unsupported(x, dy, w, slots)
        if reason:
            raise SystemExit(f"the wide kernel does not take this layer ({reason})")
        return lambda: launch_wide(x, dy, w, slots, args, stats, RULE_UPDATES["adamw"], stochastic)
    if opts.kernel == "persistent":
        reason = persistent_unsupported(x, dy, w, slots)
        if reason:
            raise SystemExit(f"the persistent kernel does not take this layer ({reason}): use --kernel triton")
        ablate = kernel_ablations.persistent_flag(opts.ablate)
        return lambda: launch_persistent(x, dy, w, slots, args, stats, RULE_UPDATES["adamw"], stochastic, ablate)
    if config is None:
        c = default_config(*w.shape, x.shape[0])
        config = (*c["blocks"], c["num_warps"], c["num_stages"])
    bn, bk, bt, warps, stages = config
    cap = {} if opts.maxnreg < 0 else dict(maxnreg=opts.maxnreg or None)
    return lambda: launch_fused_update(x, dy, w, slots, args, stats, "adamw", stochastic, blocks=(bn, bk, bt),
                                       num_warps=warps, num_stages=stages, **cap)


def parse_configs(text: str) -> list:
    if text == "default":
        return [None]
    if text == "all":
        return CONFIGS
    return [tuple(int(v) for v in config.split(",")) for config in text.split(";")]


PATHS = ("fused", "two_pass", "cublas")


def parse_paths(text: str) -> list[str]:
    paths = [p for p in text.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        raise SystemExit(f"--paths {text!r}: a comma-separated list of {list(PATHS)}")
    return paths


def two_pass_ms(opts, x, dy, w, slots, args, stats) -> tuple[float, float]:
    """GPU ms of the two-pass step, and of its GEMM alone (fp32 output), on a scratch buffer of
    this shape's own."""
    scratch = GradientScratch(w.device)

    def step():  # the two passes as dispatch's two-pass path runs them: cuBLAS's gradient, then the rule
        grad = weight_gradient(x, dy, w, scratch)
        launch_rule_step(grad, w, slots, args, stats, "adamw", opts.rounding == "stochastic")

    total = gpu_ms(step)
    gemm = gpu_ms(partial(matmul_fp32, dy.t(), x, scratch.view(*w.shape)))
    return total, gemm


def ncu_launches(opts) -> None:
    """A few launches on one shape and nothing else, for Nsight Compute to pick one."""
    shapes = {name: (n, k) for name, n, k, _ in linear_shapes(opts.model)}
    if opts.ncu not in shapes:
        raise SystemExit(f"--ncu {opts.ncu!r}: {opts.model} has the shapes {sorted(shapes)}")
    x, dy, w, state, args = layer(*shapes[opts.ncu], opts.tokens, opts.state)
    launch = launcher(opts, x, dy, w, state.kernel_slots(), args, torch.zeros(2, device="cuda"),
                      parse_configs(opts.configs)[0])
    for _ in range(opts.launches):
        launch()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES), help="whose linear shapes to sum")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--state", default="bf16", choices=STATE_PRECISIONS)
    ap.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    ap.add_argument("--kernel", default="persistent", choices=["persistent", "wide", "triton"],
                    help="persistent: the Gluon kernel (Hopper; bf16 weight, bf16, int8 or al8 state); "
                         "wide: the 128 x 128 Gluon kernel; triton: triton/fused_update.py's")
    ap.add_argument("--configs", default="default",
                    help="triton: 'default' (its own per shape), 'all' (CONFIGS, best kept) "
                         "or 'BN,BK,BT,warps,stages;...'")
    ap.add_argument("--maxnreg", type=int, default=-1,
                    help="triton: a register cap per thread (0: none; default: its own, default_config)")
    ap.add_argument("--ablate", default="none", choices=["none", *kernel_ablations.ABLATIONS],
                    help="time the kernel without one of its stages (kernel_ablations.py)")
    ap.add_argument("--paths", default="fused,cublas",
                    help="comma-separated, of fused (the --kernel kernel), two_pass (cuBLAS's fp32 gradient, "
                         "then the rule's kernel), cublas (the bf16 GEMM dY^T X alone)")
    ap.add_argument("--ncu", metavar="SHAPE", help="only launch the kernel on this shape (e.g. gate_proj/up_proj)")
    ap.add_argument("--launches", type=int, default=5, help="with --ncu")
    ap.add_argument("--out", default=None, help="also write the per-shape timings as JSON")
    add_table_option(ap)
    opts = ap.parse_args()
    if opts.kernel == "wide" and opts.ablate != "none":
        raise SystemExit(f"--ablate {opts.ablate}: the wide kernel has no ablations (persistent and triton do)")
    if opts.kernel == "triton" and opts.ablate != "none":
        kernel_ablations.apply_triton(opts.ablate)
    if opts.ncu:
        return ncu_launches(opts)
    paths = parse_paths(opts.paths)
    bandwidth, flops = ceilings()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    rows = []
    totals = dict.fromkeys(("fused", "floor", "two_pass", "two_pass_gemm", "auto", "cublas"), 0.0)
    for name, n, k, count in linear_shapes(opts.model):
        x, dy, w, state, args = layer(n, k, opts.tokens, opts.state)
        slots, stats = state.kernel_slots(), torch.zeros(2, device=w.device)
        moved = 2 * opts.tokens * (n + k) + 2 * w.numel() * w.element_size() + 2 * state.nbytes()
        floor = max(moved / bandwidth, 2 * opts.tokens * n * k / flops) * 1e3
        row = dict(shape=name, out=n, inp=k, count=count, floor_ms=floor)
        parts = []
        if "fused" in paths:
            timings = {}
            for config in parse_configs(opts.configs) if opts.kernel == "triton" else [None]:
                try:
                    timings[str(config or "default")] = gpu_ms(launcher(opts, x, dy, w, slots, args, stats, config))
                except Exception as e:  # noqa: BLE001 - a config may not fit shared memory: a result too
                    print(name, config, type(e).__name__, str(e)[:100])
            best = min(timings, key=timings.get)
            row.update(best_ms=timings[best], best_config=best, timings_ms=timings)
            totals["fused"] += timings[best] * count
            totals["floor"] += floor * count
            parts.append(f"kernel {timings[best]:.3f} ms ({best}), floor {floor:.3f} "
                         f"({100 * floor / timings[best]:.0f}%)")
        if "two_pass" in paths:
            row["two_pass_ms"], row["two_pass_gemm_ms"] = two_pass_ms(opts, x, dy, w, slots, args, stats)
            totals["two_pass"] += row["two_pass_ms"] * count
            totals["two_pass_gemm"] += row["two_pass_gemm_ms"] * count
            parts.append(f"two-pass {row['two_pass_ms']:.3f} (GEMM fp32 out {row['two_pass_gemm_ms']:.3f})")
        if "fused" in paths and "two_pass" in paths:  # dispatch's auto rule on these times
            row["auto_path"] = "fused" if x.shape[0] < MANY_TOKENS else \
                faster_path(row["best_ms"], row["two_pass_ms"])
            totals["auto"] += row[{"two_pass": "two_pass_ms", "fused": "best_ms"}[row["auto_path"]]] * count
            parts[-1] += f" -> {row['auto_path']}"
        if "cublas" in paths:
            row["cublas_wgrad_ms"] = gpu_ms(partial(torch.mm, dy.t(), x))
            totals["cublas"] += row["cublas_wgrad_ms"] * count
            parts.append(f"cuBLAS dW {row['cublas_wgrad_ms']:.3f}")
        rows.append(row)
        print(f"{name:18s} {n:6d}x{k:6d} x{count:<3d} " + ", ".join(parts))
        del x, dy, w, state, args, slots
    summed = []
    if "fused" in paths:
        summed.append(f"kernel {totals['fused']:.2f} ms, floor {totals['floor']:.2f} ms "
                      f"({100 * totals['floor'] / totals['fused']:.1f}%)")
    if "two_pass" in paths:
        summed.append(f"two-pass {totals['two_pass']:.2f} ms (its GEMMs {totals['two_pass_gemm']:.2f})")
    if "fused" in paths and "two_pass" in paths:
        summed.append(f"auto {totals['auto']:.2f} ms")
    if "cublas" in paths:
        summed.append(f"cuBLAS dW {totals['cublas']:.2f} ms")
    print("model sum: " + ", ".join(summed))

    setup = f"AdamW, {opts.rounding} rounding, CUDA-graph replays, sum over {sum(r['count'] for r in rows)} linears"
    batch = f"1x{opts.tokens}"
    table = []
    if "fused" in paths:
        arm = f"kernel_{opts.kernel}_{opts.state}" + ("" if opts.ablate == "none" else f"_{opts.ablate}")
        fused_setup = setup
        if opts.kernel == "triton":
            fused_setup += f", configs {opts.configs}" + (f", maxnreg {opts.maxnreg}" if opts.maxnreg >= 0 else "")
        table += [
            dict(arm=arm, step_ms=totals["fused"],
                 note=f"{fused_setup}; {100 * totals['floor'] / totals['fused']:.1f}% of the memory floor"),
            dict(arm=f"memory_floor_{opts.state}", step_ms=totals["floor"],
                 note=f"bytes moved at the measured copy bandwidth {bandwidth / 1e12:.2f} TB/s"),
        ]
    if "two_pass" in paths:
        table.append(dict(arm=f"two_pass_{opts.state}", step_ms=totals["two_pass"],
                          note=f"{setup}; cuBLAS fp32-output dY^T X into a scratch buffer "
                               f"({totals['two_pass_gemm']:.2f} ms of it), then the rule's kernel over it"))
    if "fused" in paths and "two_pass" in paths:
        picks = ", ".join(f"{r['shape']} {r['auto_path']}" for r in rows)
        table.append(dict(arm=f"auto_{opts.kernel}_{opts.state}", step_ms=totals["auto"],
                          note=f"{setup}; per shape the faster path by dispatch's rule "
                               f"(from {MANY_TOKENS} tokens, two-pass under {TWO_PASS_MARGIN} of fused): {picks}"))
    if "cublas" in paths:
        table.append(dict(arm="cublas_wgrad", step_ms=totals["cublas"],
                          note="torch.mm(dy.t(), x) per shape, bf16, CUDA-graph replays"))
    append_rows([dict(model=opts.model, batch=batch, tool="kernel_microbench", **r) for r in table], opts.table)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(vars(opts), table=str(opts.table), bandwidth=bandwidth, matmul_flops=flops, rows=rows,
                           total_ms=totals["fused"], floor_ms=totals["floor"], two_pass_ms=totals["two_pass"],
                           auto_ms=totals["auto"], cublas_wgrad_ms=totals["cublas"]), f, indent=1)

if __name__ == "__main__":
    main()
