"""The rule step of a parameter whose gradient exists (ForgeOptimizer's non-fused ones: a
Llama-3.1-8B embedding, 128256 x 4096), AdamW, bf16 against int8 state, for a few tile
shapes and launch options of fused_update.py's kernel: GPU time of CUDA-graph replays.
Usage: python benchmarks/rule_step_probe.py [--out F]"""
import argparse
import json

import torch

from forge_hf.kernels.fused_update import _launch, default_config, kernel_call

from persistent_probe import gpu_time, setup

# (block_n, block_k, num_warps, num_stages); block_k a multiple of 64 (8-bit codec blocks)
CONFIGS = [(64, 64, 4, 4), (64, 128, 4, 2), (32, 256, 4, 2), (64, 256, 8, 2), (128, 128, 8, 2), (16, 512, 4, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    n, k = 128256, 4096
    rows = []
    for precision in ("bf16", "int8"):
        x, dy, w, slots, args = setup(n, k, 64, precision)
        grad = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 1e-3
        stats = torch.zeros(2, device="cuda")
        for bn, bk, warps, stages in CONFIGS:
            config = dict(default_config(n, k, 0), num_warps=warps, num_stages=stages)
            grid, positional, constexprs = kernel_call(grad, grad, w, slots, args, stats, "adamw", True,
                                                       (bn, bk, 64), grad_given=True)
            try:
                ms = gpu_time(lambda: _launch(grid, positional, constexprs, config))
            except Exception as e:  # a config that does not compile or fit is a result too
                ms = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(dict(precision=precision, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, ms=ms))
            print(rows[-1], flush=True)
    if opts.out:
        json.dump(dict(shape=[n, k], rows=rows), open(opts.out, "w"), indent=1)


if __name__ == "__main__":
    main()
