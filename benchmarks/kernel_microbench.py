"""Fused-kernel time per Llama-3.1-8B linear shape at 512 tokens, against its floor.

Floor = max(bytes it must move / measured HBM copy bandwidth, FLOPs / measured bf16
matmul rate). Bytes: read x and dy once, read and write the weight and each state (codes
and block metadata for the 8-bit precisions).
Also times cuBLAS forming the same weight gradient (dY^T X, bf16 out): the matmul part
alone, for reference.
Usage: python benchmarks/kernel_microbench.py [--state fp32|bf16|int8|al8] [--configs all|default]
       [--maxnreg N] [--variant NAME (kernel_variants.py)] [--out results.json]
"""

import argparse
import json

import torch
import triton

import kernel_variants
from forge_hf.kernels.fused_update import default_config, launch_fused_update
from forge_hf.step_args import ARGS_LEN, pack_args
from forge_hf.rules import get_rule, make_group
from forge_hf.state import STATE_PRECISIONS, ForgeState

# (name, out_features, in_features, count per model) for Llama-3.1-8B
LLAMA8B = [("q_proj/o_proj", 4096, 4096, 64), ("k_proj/v_proj", 1024, 4096, 64),
           ("gate/up_proj", 14336, 4096, 64), ("down_proj", 4096, 14336, 32), ("lm_head", 128256, 4096, 1)]
# (BLOCK_N, BLOCK_K, BLOCK_T, warps, stages). The epilogue is latency-bound at one or two
# programs per SM (Nsight Compute: 12.5% occupancy, 218 registers a thread), so the
# candidates spread a tile over more warps: 16 elements a thread need ~100 registers.
CONFIGS = [
    (64, 64, 64, 8, 3), (64, 64, 64, 8, 4), (64, 64, 64, 8, 2), (64, 64, 128, 8, 2), (64, 64, 32, 8, 4),
    (64, 128, 64, 16, 3), (128, 64, 64, 16, 3), (32, 64, 64, 4, 3), (32, 128, 64, 8, 3),
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
]


def ceilings():
    a = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    bw = 2 * a.numel() * 2 / (ms * 1e-3)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: m @ m, return_mode="median")
    return bw, 2 * 8192**3 / (ms * 1e-3)


def _flat(config: dict) -> tuple:
    return (*config["blocks"], config["num_warps"], config["num_stages"])


def parse_configs(text: str, n: int, k: int, tokens: int) -> list[tuple]:
    if text == "all":
        return CONFIGS
    if text == "default":
        return [_flat(default_config(n, k, tokens))]
    return [tuple(int(v) for v in config.split(",")) for config in text.split(";")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--state", default="bf16", choices=STATE_PRECISIONS)
    ap.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    ap.add_argument("--configs", default="all",
                    help="'all', 'default' (the kernel's own choice per shape), or 'BN,BK,BT,warps,stages;...'")
    ap.add_argument("--maxnreg", type=int, default=-1,
                    help="a register cap per thread (0: none; default: the kernel's own, default_config)")
    ap.add_argument("--variant", default="base", help="a benchmark-only kernel variant (kernel_variants.py)")
    opts = ap.parse_args()
    kernel_variants.apply(opts.variant)
    bw, flops = ceilings()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-5))
    rows, total_best, total_floor = [], 0.0, 0.0
    for name, n, k, count in LLAMA8B:
        T = opts.tokens
        x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        state = ForgeState(rule, opts.state, transposed=False)  # the layout a fused layer allocates
        state.allocate(w, group)
        slots = state.kernel_slots()
        stats = torch.zeros(2, device="cuda")
        host = rule.host_init()
        args = pack_args(rule.prepare(group, host), host["step"], 1234, "cuda")
        assert args.numel() == ARGS_LEN
        moved = 2 * T * (n + k) + 2 * (2 * n * k) + 2 * state.nbytes()
        floor_ms = max(moved / bw, 2 * T * n * k / flops) * 1e3
        gemm_ms = triton.testing.do_bench(lambda: torch.mm(dy.t(), x), return_mode="median")
        timings = {}
        configs = parse_configs(opts.configs, n, k, T)
        cap = {} if opts.maxnreg < 0 else dict(maxnreg=opts.maxnreg or None)
        for cfg in configs:
            bn, bk, bt, nw, ns = cfg
            fn = lambda: launch_fused_update(x, dy, w, slots, args, stats, "adamw", opts.rounding == "stochastic",
                                             blocks=(bn, bk, bt), num_warps=nw, num_stages=ns, **cap)
            try:
                timings[str(cfg)] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # a config may not fit shared memory
                timings[str(cfg)] = None
                print(name, cfg, type(e).__name__, str(e)[:80])
        best_cfg = min((c for c in timings if timings[c] is not None), key=timings.get)
        best = timings[best_cfg]
        total_best += best * count
        total_floor += floor_ms * count
        rows.append(dict(shape=name, out=n, inp=k, tokens=T, count=count, floor_ms=floor_ms,
                         cublas_grad_ms=gemm_ms, best_ms=best, best_config=best_cfg, pct_of_floor=100 * floor_ms / best,
                         timings_ms=timings))
        print(f"{name:14s} {n:6d}x{k:6d} floor {floor_ms:.3f} ms best {best:.3f} ms "
              f"({100 * floor_ms / best:.0f}% of floor) {best_cfg}; cuBLAS dW alone {gemm_ms:.3f} ms")
    print(f"model total: fused {total_best:.1f} ms vs floor {total_floor:.1f} ms "
          f"({100 * total_floor / total_best:.0f}%)")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(bandwidth=bw, matmul_flops=flops, state=opts.state, rounding=opts.rounding,
                           variant=opts.variant, maxnreg=opts.maxnreg, rows=rows,
                           total_ms=total_best, total_floor_ms=total_floor), f, indent=1)


if __name__ == "__main__":
    main()
