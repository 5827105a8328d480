"""One GPU run: the fused AdamW step as an epilogue of QuACK's sm90 GEMM
(forge_hf/kernels/cute/) against forge's reference and Triton kernels, then timed against
cuBLAS's weight gradient over Llama-3.1-8B's linear shapes.

  (a) correctness: weight and moments after one step, in bf16 ulps from the reference backend
      (kernels/reference.py) and from the Triton kernel, on shapes that are not multiples of
      the tiles and on Llama shapes;
  (b) timing (CUDA-graph replays, median) per shape at each token count: cuBLAS's dY^T X, the
      engine's plain GEMM (fp32 and bf16 out) and the fused step, for a few tile configs;
      sums over the model's linears (shape x count) and ratios to cuBLAS;
  (c) rows in a results table ($OUT/results.csv, or --table) and a JSON ($OUT/cute_probe.json).

Each arm's exception is printed and the run goes on. Needs quack-kernels and
nvidia-cutlass-dsl (forge-hf[hopper]) and a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402

from forge_hf.core.launch_args import pack_args  # noqa: E402
from forge_hf.core.rules import get_rule, make_group  # noqa: E402

from models import linear_shapes  # noqa: E402
from results_table import append_rows  # noqa: E402

# (tile_m, tile_n, cluster_m, cluster_n, pingpong): QuACK's sm90 default first
CONFIGS = {"128x192pp": (128, 192, 2, 1, True), "128x128pp": (128, 128, 2, 1, True),
           "128x64pp": (128, 64, 2, 1, True), "128x256co": (128, 256, 2, 1, False)}
SALT = 1234
LOG: list[str] = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def attempt(what, fn):
    """fn(), or None with the exception printed: one arm's failure keeps the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        say(f"FAILED {what}: {type(e).__name__}: {str(e)[:400]}")
        traceback.print_exc(limit=4)
        torch.cuda.synchronize()
        return None


def layer(n, k, t, seed=0):
    """x, dy, weight, moments (bf16) and the launch's argument row three AdamW steps in."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = (torch.randn(t, n, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    m = (torch.randn(n, k, device="cuda", generator=g) * 1e-4).to(torch.bfloat16)
    v = (torch.rand(n, k, device="cuda", generator=g) * 1e-6).to(torch.bfloat16)
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3, weight_decay=0.01))
    host = rule.host_init()
    for _ in range(3):
        scalars = rule.prepare(group, host)
    return x, dy, w, m, v, pack_args(scalars, host["step"], SALT, "cuda")


def ulps(a, b):
    """Distance in bf16 steps (sign-magnitude bits on one line)."""
    def line(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (line(a) - line(b)).abs()


def compare(got, want):
    d = ulps(got, want)
    return dict(max_ulps=int(d.max()), equal=float((d == 0).float().mean()))


# ------------------------------------------------------------------ (a) correctness


def check(W, n, k, t, stochastic, cfg, with_reference):
    from forge_hf.kernels.dispatch import launch_fused_update
    from forge_hf.kernels.reference import reference_fused_update
    x, dy, w, m, v, args = layer(n, k, t)
    result = dict(shape=f"{n}x{k}@{t}", stochastic=stochastic)
    mine = [w.clone(), m.clone(), v.clone()]
    start = time.time()
    W.fused_step(x, dy, mine[0], mine[1:], args, "adamw", stochastic=stochastic, cfg=cfg)
    torch.cuda.synchronize()
    result["first_call_s"] = round(time.time() - start, 1)
    others = {}
    tri = [w.clone(), m.clone(), v.clone()]
    launch_fused_update(x, dy, tri[0], [tri[1], tri[2], None], args, torch.zeros(2, device="cuda"), "adamw",
                        stochastic, blocks=(64, 64, 64))
    others["triton"] = tri
    if with_reference:
        ref = [w.clone(), m.clone(), v.clone()]
        reference_fused_update(x, dy, ref[0], [ref[1], ref[2], None], args, torch.zeros(2, device="cuda"),
                               "adamw", stochastic)
        others["reference"] = ref
    # the gradient alone, as a scale for the update's effect
    for name, other in others.items():
        for label, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), mine, other):
            result[f"{name}_{label}"] = compare(a, b)
    result["weight_moved"] = float((ulps(mine[0], w) > 0).float().mean())
    say(f"check {result['shape']:>18s} {'SR' if stochastic else 'RN'}: " + ", ".join(
        f"{key} {val['max_ulps']}ulp/{100 * val['equal']:.2f}%eq" for key, val in result.items()
        if isinstance(val, dict)) + f"; {100 * result['weight_moved']:.0f}% of weights moved")
    return result


def checks(W, cfg):
    out = []
    cases = [(256, 384, 100, True), (1000, 1496, 777, True), (1000, 1496, 777, False), (4096, 4096, 2048, True),
             (1024, 4096, 2048, True), (14336, 4096, 777, True), (4096, 14336, 4096, False)]
    for case in cases:
        small = case[0] * case[1] <= 2**24  # the reference's tile loop takes seconds beyond
        res = attempt(f"check {case}", lambda case=case, small=small: check(W, *case, cfg, with_reference=small))
        if res:
            out.append(res)
    x, dy, w, m, v, args = layer(1000, 1500, 64)
    try:
        W.fused_step(x, dy, w, [m, v], args, "adamw")
        say("check 1000x1500: NOT refused (TMA needs 16-byte strides)")
    except ValueError as e:
        say(f"check 1000x1500: refused as expected ({e})")
    return out


# ------------------------------------------------------------------ (b) timing


def gpu_ms(fn):
    """Median ms over CUDA-graph replays; over eager launches where capture fails."""
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"), "graph"
    except Exception as e:  # noqa: BLE001
        say(f"  (no graph: {type(e).__name__}: {str(e)[:120]}; eager timing)")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median"), "eager"


def state_slots(w, m, v, precision):
    """The moments m, v held in ``precision`` (bf16 as they are; int8 or al8 encoded), as the
    kernel's slots."""
    if precision == "bf16":
        return [m, v]
    from forge_hf.core.state import ForgeState
    rule = get_rule("adamw")
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, make_group(rule, dict(lr=1e-3, weight_decay=0.01)))
    slots = state.kernel_slots()[:2]
    for slot, value in zip(slots, (m, v)):
        slot.write(value.float())
    return slots


def time_shape(W, name, n, k, count, tokens, configs, precision):
    x, dy, w, m, v, args = layer(n, k, tokens)
    slots = state_slots(w, m, v, precision)
    out32 = torch.empty(n, k, device="cuda")
    out16 = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    row = dict(shape=name, out=n, inp=k, count=count, tokens=tokens)
    row["cublas"] = attempt(f"cublas {name}", lambda: gpu_ms(lambda: torch.mm(dy.t(), x))[0])
    stats = torch.zeros(2, device="cuda")  # recorded, as the dispatch's launches do
    for label, c in configs.items():
        cfg = W.config(*c)
        row[f"gemm_fp32_{label}"] = attempt(f"gemm fp32 {label} {name}",
                                            lambda cfg=cfg: gpu_ms(lambda: W.wgrad(x, dy, out32, cfg))[0])
        row[f"gemm_bf16_{label}"] = attempt(f"gemm bf16 {label} {name}",
                                            lambda cfg=cfg: gpu_ms(lambda: W.wgrad(x, dy, out16, cfg))[0])
        row[f"fused_{label}"] = attempt(f"fused {label} {name}", lambda cfg=cfg: gpu_ms(
            lambda: W.fused_step(x, dy, w, slots, args, "adamw", stochastic=True, cfg=cfg, stats=stats))[0])
    say(f"{tokens:5d} {name:18s} {n:6d}x{k:<6d} x{count:<3d} " + " ".join(
        f"{key} {val:.3f}" for key, val in row.items() if isinstance(val, float)))
    return row


def timings(W, tokens, configs, precision):
    rows = []
    for name, n, k, count in linear_shapes("llama-3.1-8b"):
        rows.append(time_shape(W, name, n, k, count, tokens, configs, precision))
        torch.cuda.empty_cache()
    return rows


def sums(rows):
    """Per arm, the model's sum (ms) over shapes x count; None if any shape failed. Best-of
    arms: per shape the fastest config (what a per-shape choice would give)."""
    arms = sorted({key for r in rows for key, v in r.items() if key not in ("shape", "out", "inp", "count", "tokens")})
    total = {}
    for arm in arms:
        vals = [r.get(arm) for r in rows]
        total[arm] = None if any(v is None for v in vals) else sum(v * r["count"] for v, r in zip(vals, rows))
    for prefix in ("gemm_fp32_", "gemm_bf16_", "fused_"):
        best = []
        for r in rows:
            vals = [v for key, v in r.items() if key.startswith(prefix) and v is not None]
            best.append(min(vals) * r["count"] if vals else None)
        total[prefix + "best"] = None if any(b is None for b in best) else sum(best)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {list(CONFIGS)}")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--state", default="bf16", choices=["bf16", "int8", "al8"], help="the fused step's AdamW moments")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and the results table")
    ap.add_argument("--table", default=None, help="results table (default: OUT/results.csv)")
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    say(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    from forge_hf.kernels import cute
    W = cute.load()
    import cutlass
    import quack
    say(f"cutlass-dsl {getattr(cutlass, '__version__', '?')}, quack {getattr(quack, '__version__', '?')}")
    configs = {name: CONFIGS[name] for name in opts.configs.split(",")}
    report = dict(configs=configs, checks=[], timings={}, sums={})
    if not opts.skip_checks:
        report["checks"] = checks(W, W.DEFAULT_CONFIG)
        say(f"checks done at {time.time() - started:.0f} s")
    for tokens in (int(t) for t in opts.tokens.split(",")):
        rows = timings(W, tokens, configs, opts.state)
        report["timings"][tokens] = rows
        report["sums"][tokens] = sums(rows)
        say(f"timings at {tokens} done at {time.time() - started:.0f} s")
    with open(out / "cute_probe.json", "w") as f:
        json.dump(dict(report, log=LOG), f, indent=1)

    table = []
    say("\nmodel sums over Llama-3.1-8B's 225 linears (ms), ratio to cuBLAS's dY^T X:")
    for tokens, total in report["sums"].items():
        cublas = total.get("cublas")
        for arm, ms in sorted(total.items()):
            ratio = f"{ms / cublas:.3f}x" if ms and cublas else "-"
            say(f"  {tokens:5d} {arm:22s} {ms if ms is None else round(ms, 2)!s:>8s}  {ratio}")
            if ms is None:
                continue
            name = {"cublas": "cublas_wgrad"}.get(arm, arm.replace("gemm_", "engine_quack_gemm_")
                                                   .replace("fused_", f"kernel_cute_{opts.state}_"))
            table.append(dict(model="llama-3.1-8b", batch=f"1x{tokens}", arm=name, step_ms=ms, tool="cute_probe",
                              note=f"QuACK sm90 GEMM engine; {ratio} cuBLAS; AdamW {opts.state} state, stochastic "
                                   "rounding, "
                                   "tile statistics and non-finite skip; CUDA-graph replays, sum over 225 linears"))
    if table:
        path = attempt("results table", lambda: append_rows(table, opts.table or out / "results.csv"))
        say(f"{len(table)} rows -> {path}")
    say(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
