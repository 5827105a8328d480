"""Host (CPU) cost of a fused step, on a GPU machine: microseconds per launch of the fused
kernel through forge's launcher, through Triton's JIT dispatch with prepared arguments, and
through the compiled kernel directly; then a cProfile of whole training steps.

    python benchmarks/host_overhead.py [--model qwen3-0.6b] > host_overhead.txt
"""

import argparse
import cProfile
import pstats
import time

import torch

import forge_hf
from forge_hf.kernels.fused_update import fused_update_kernel, kernel_call, launch_fused_update
from forge_hf.step_args import pack_args
from forge_hf.rules import get_rule, make_group
from forge_hf.state import ForgeState
from models import build_model


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def launch_costs():
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-5))
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    state = ForgeState(rule, "bf16", transposed=False)
    state.allocate(w, group)
    stats = torch.zeros(2, device="cuda")
    slots = state.kernel_slots()
    args = pack_args(rule.prepare(group, state.host), 1, 7, "cuda")
    grid, positional, constexprs = kernel_call(x, dy, w, slots, args, stats, "adamw", True)
    grid = (*grid, 1)
    compiled = fused_update_kernel[grid](*positional, **constexprs, num_warps=4, num_stages=3)
    names = fused_update_kernel.arg_names
    every = positional + [constexprs[n] for n in names[len(positional):]]
    runner = compiled[grid]
    print("us per call (host, tiny layer):")
    print("  pack_args + prepare   ", round(per_call_us(lambda: pack_args(rule.prepare(group, dict(state.host)), 1, 7, "cuda")), 1))
    print("  kernel_call           ", round(per_call_us(lambda: kernel_call(x, dy, w, slots, args, stats, "adamw", True)), 1))
    print("  launch_fused_update   ", round(per_call_us(lambda: launch_fused_update(x, dy, w, slots, args, stats, "adamw", True)), 1))
    print("  JIT dispatch only     ", round(per_call_us(lambda: fused_update_kernel[grid](*positional, **constexprs, num_warps=4, num_stages=3)), 1))
    print("  compiled kernel runner", round(per_call_us(lambda: runner(*every)), 1))
    print("  torch add_ (reference)", round(per_call_us(lambda: w.add_(0)), 1))


def profile_training(model_name, steps):
    model = build_model(model_name)
    forge_hf.patch_model(model, optimizer="adamw", state_precision="bf16", lr=1e-5, weight_decay=0.01)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-5, weight_decay=0.01)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(f"{model_name}: {(time.perf_counter() - t) / steps * 1e3:.1f} ms per step (wall, no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=5)
    opts = ap.parse_args()
    launch_costs()
    profile_training(opts.model, opts.steps)


if __name__ == "__main__":
    main()
