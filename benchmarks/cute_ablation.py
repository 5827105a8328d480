"""Where the QuACK fused step's time goes: the fused epilogue beside variants that leave one
part out (benchmarks/cute_variants.py), on chosen Llama-3.1-8B shapes, timed by CUDA-graph
replay (median), with QuACK's plain GEMM and cuBLAS as the floor.

  python benchmarks/cute_ablation.py --shapes gate_proj --tokens 2048,4096
  python benchmarks/cute_ablation.py --epi-tile 64x64 --variants fused_sr,copy_through
  ncu ... python benchmarks/cute_ablation.py --ncu fused_sr --shapes gate_proj --tokens 2048

Variants: fused_sr / fused_rn (the step with its statistics, stochastic or nearest rounding;
_unrolled: with QuACK's own epilogue driver, its subtiles unrolled), copy_through (its loads
and stores, no arithmetic), stores_only, weight_only (one load, one store), math_sr / math_rn
(the rule and roundings, no loads), plain_bf16 (the GEMM alone). --epi-tile overrides
QuACK's epilogue subtile (M x N), --epi-c-stages its epilogue load stages and --cluster the
cluster shape, for every kernel of the process; QuACK's disk cache is off so an override never
meets a kernel built without it. Rows go to the results table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ["QUACK_CACHE_ENABLED"] = "0"

import torch  # noqa: E402

from cute_probe import CONFIGS, attempt, gpu_ms, layer, say  # noqa: E402
from models import linear_shapes  # noqa: E402
from results_table import append_rows  # noqa: E402

VARIANTS = ("plain_bf16", "fused_sr", "fused_rn", "fused_sr_unrolled", "fused_rn_unrolled", "copy_through",
            "stores_only", "weight_only", "math_sr", "math_rn")


def launcher(name, W, V, x, dy, w, m, v, args, cfg):
    """A no-argument call of one variant on this layer's tensors."""
    n, k = w.shape
    outs = {"D": w, "exp_avg_new": m, "exp_avg_sq_new": v}
    scalars = dict(elem=k, k_cols=k, **W.scalar_views(args, "adamw"))
    kw = dict(config=cfg, tuned=False)
    stats = torch.zeros(2, device=w.device)  # the rolled step records, as the dispatch's launches do
    calls = {
        "plain_bf16": lambda: W.wgrad(x, dy, w, cfg),
        "fused_sr": lambda: W.fused_step(x, dy, w, [m, v], args, "adamw", stochastic=True, cfg=cfg, stats=stats),
        "fused_rn": lambda: W.fused_step(x, dy, w, [m, v], args, "adamw", stochastic=False, cfg=cfg, stats=stats),
        "fused_sr_unrolled": lambda: W.fused_step(x, dy, w, [m, v], args, "adamw", stochastic=True, cfg=cfg,
                                                  rolled=False),
        "fused_rn_unrolled": lambda: W.fused_step(x, dy, w, [m, v], args, "adamw", stochastic=False, cfg=cfg,
                                                  rolled=False),
        "copy_through": lambda: V.copy_through(dy.t(), x, w, out=outs, exp_avg=m, exp_avg_sq=v, **kw),
        "stores_only": lambda: V.stores_only(dy.t(), x, out=outs, **kw),
        "weight_only": lambda: V.weight_only(dy.t(), x, w, out={"D": w}, **kw),
        "math_sr": lambda: V.MATH_ONLY[True](dy.t(), x, out=outs, **scalars, **kw),
        "math_rn": lambda: V.MATH_ONLY[False](dy.t(), x, out=outs, **scalars, **kw),
    }
    return calls[name]


def kernels_of(fn) -> str:
    """The kernels one call launches, with their GPU times (torch.profiler): a copy or fill
    hidden in the call shows here."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return "; ".join(f"{e.name[:60]} {e.device_time / 1e3:.3f} ms" for e in events) or "no kernel seen"


def override_epi_c_stages(stages):
    """Every kernel built later in this process stages up to ``stages`` epilogue loads (QuACK: 4,
    more where shared memory is left): the loads issued at the epilogue's start, before any wait."""
    from quack.gemm_sm90 import GemmSm90
    GemmSm90.epi_c_stage_base = stages


def override_epi_tile(spec):
    """Every kernel built later in this process takes ``spec`` (MxN) as its epilogue subtile."""
    from quack.gemm_sm90 import GemmSm90
    tile = tuple(int(d) for d in spec.split("x"))
    GemmSm90._compute_tile_shape_or_override = staticmethod(lambda *a, **k: tile)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    ap.add_argument("--shapes", default="gate_proj", help="names from models.linear_shapes('llama-3.1-8b')")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--config", default="128x128pp", choices=sorted(CONFIGS))
    ap.add_argument("--epi-tile", default=None, help="MxN epilogue subtile for every kernel (QuACK picks otherwise)")
    ap.add_argument("--epi-c-stages", type=int, default=None, help="epilogue load stages for every kernel")
    ap.add_argument("--cluster", default=None, help="MxN cluster in place of the config's")
    ap.add_argument("--kernels", action="store_true", help="list the kernels each variant's call launches")
    ap.add_argument("--ncu", default=None, metavar="VARIANT", help="launch VARIANT 5 times, untimed, for a profiler")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--table", default=None)
    opts = ap.parse_args()
    from forge_hf.kernels import cute
    W = cute.load()
    if opts.epi_tile:
        override_epi_tile(opts.epi_tile)
    if opts.epi_c_stages:
        override_epi_c_stages(opts.epi_c_stages)
    import cute_variants as V
    tile_m, tile_n, cluster_m, cluster_n, pingpong = CONFIGS[opts.config]
    if opts.cluster:
        cluster_m, cluster_n = (int(d) for d in opts.cluster.split("x"))
    cfg = W.config(tile_m, tile_n, cluster_m, cluster_n, pingpong)
    wanted = opts.shapes.split(",")
    shapes = [s for s in linear_shapes("llama-3.1-8b") if any(w in s[0].split("/") for w in wanted)]
    if opts.ncu:
        name, n, k, _ = shapes[0]
        fn = launcher(opts.ncu, W, V, *layer(n, k, int(opts.tokens.split(",")[0])), cfg)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        say(f"ncu: {opts.ncu} on {name} launched 5 times")
        return
    tag = opts.config + "".join(f"_{name}{value}" for name, value in (
        ("epi", opts.epi_tile), ("cstages", opts.epi_c_stages), ("cluster", opts.cluster)) if value)
    rows = []
    for tokens in (int(t) for t in opts.tokens.split(",")):
        for name, n, k, _ in shapes:
            tensors = layer(n, k, tokens)
            x, dy = tensors[0], tensors[1]
            cublas = gpu_ms(lambda x=x, dy=dy: torch.mm(dy.t(), x))[0]
            line = [f"{tokens:5d} {name:18s} cublas {cublas:.3f}"]
            rows.append(dict(model="llama-3.1-8b", batch=f"1x{tokens}", arm=f"cublas_wgrad_{name}", step_ms=cublas,
                             tool="cute_ablation", note=f"{n}x{k}; CUDA-graph replays, median"))
            for variant in opts.variants.split(","):
                started = time.time()
                fn = launcher(variant, W, V, *tensors, cfg)
                ms = attempt(f"{variant} {name}@{tokens}", lambda fn=fn: gpu_ms(fn)[0])
                if ms is None:
                    continue
                line.append(f"{variant} {ms:.3f} ({ms / cublas:.2f}x; built+timed {time.time() - started:.0f} s)")
                if opts.kernels:
                    say(f"  kernels of {variant}: {attempt('profiler', lambda fn=fn: kernels_of(fn))}")
                rows.append(dict(model="llama-3.1-8b", batch=f"1x{tokens}", arm=f"ablation_cute_{variant}_{tag}_{name}",
                                 step_ms=ms, tool="cute_ablation",
                                 note=f"{n}x{k}; {ms / cublas:.3f}x cuBLAS; CUDA-graph replays, median"))
            say(" | ".join(line))
            del tensors
            torch.cuda.empty_cache()
    if rows:
        path = append_rows(rows, opts.table or Path(opts.out) / "results.csv")
        say(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
