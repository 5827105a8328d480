"""Launch the fused kernel a few times on one Llama-3.1-8B shape, for Nsight Compute:

    ncu --kernel-name regex:fused_update --launch-skip 3 --launch-count 1 --set full \\
        python benchmarks/profile_kernel.py --out 14336 --inp 4096 --state bf16
"""

import argparse

import torch

from forge_hf.kernels.fused_update import launch_fused_update
from forge_hf.step_args import pack_args
from forge_hf.rules import get_rule, make_group
from forge_hf.state import ForgeState


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=int, default=14336)
    ap.add_argument("--inp", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--state", default="bf16")
    ap.add_argument("--launches", type=int, default=5)
    opts = ap.parse_args()
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-5))
    x = torch.randn(opts.tokens, opts.inp, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(opts.tokens, opts.out, device="cuda", dtype=torch.bfloat16) * 1e-3
    w = torch.randn(opts.out, opts.inp, device="cuda", dtype=torch.bfloat16) * 0.02
    state = ForgeState(rule, opts.state, transposed=False)
    state.allocate(w, group)
    stats = torch.zeros(2, device="cuda")
    for _ in range(opts.launches):
        args = pack_args(rule.prepare(group, state.host), state.host["step"], 1234, "cuda")
        launch_fused_update(x, dy, w, state.kernel_slots(), args, stats, "adamw", True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
