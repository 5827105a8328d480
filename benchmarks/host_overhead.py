"""Host (CPU) cost of a fused step, on a GPU machine: microseconds per launch of the fused
kernels through forge's launchers, through Triton's JIT dispatch with prepared arguments, and
through the compiled kernel directly; then the wall time and a cProfile of whole eager
training steps. The per-call costs (in ms) and the step are rows of the results table.

    python benchmarks/host_overhead.py [--model qwen3-0.6b] > host_overhead.txt
"""

import argparse
import cProfile
import pstats
import time

import torch
import triton

import forge_hf
from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels import BoundLaunch, launch_fused_update, next_launch_args, pack_args
from forge_hf.kernels.launch.persistent_launch import PersistentLaunch, launch_persistent, persistent_unsupported
from forge_hf.kernels.runtime.compiled import launch_compiled
from forge_hf.kernels.triton.fused_update import RULE_UPDATES, fused_launch_arguments, fused_update_kernel

from models import SHAPES, build_model, linear_shapes
from results_table import add_table_option, append_rows


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


LAYERS_A_STEP = 196  # Qwen3-0.6B's fused layers


def step_of_launch_args(rule, group, states, device) -> None:
    for state in states:
        next_launch_args(rule, group, state, 7, device)


def launch_costs() -> dict:
    """Host microseconds per call of each step of a launch, on a 64 x 64 layer at 16 tokens."""
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
    grid, positional, constexprs = fused_launch_arguments(x, dy, w, slots, args, stats, "adamw", True)
    grid = (*grid, 1)
    compiled = fused_update_kernel[grid](*positional, **constexprs, num_warps=4, num_stages=3)
    names = fused_update_kernel.arg_names
    every = positional + [constexprs[n] for n in names[len(positional):]]
    runner = compiled[grid]
    again = launch_compiled(fused_update_kernel, grid, positional, constexprs, dict(num_warps=4, num_stages=3))
    bound = BoundLaunch(w, slots, "adamw", True)
    rule_pass = BoundLaunch(w, slots, "adamw", True, grad_given=True)
    grad = torch.zeros(64, 64, device="cuda")
    layer_states = [ForgeState(rule, "bf16", transposed=False) for _ in range(LAYERS_A_STEP)]
    calls = {
        "pack_args": lambda: pack_args(rule.prepare(group, dict(state.host)), 1, 7, "cuda"),
        "next_launch_args": lambda: next_launch_args(rule, group, state, 7, w.device),
        # a step of a model's fused layers, the way its backward asks: one table copy a step
        "next_launch_args_in_a_step": lambda: step_of_launch_args(rule, group, layer_states, w.device),
        "fused_launch_arguments": lambda: fused_launch_arguments(x, dy, w, slots, args, stats, "adamw", True),
        "launch_fused_update": lambda: launch_fused_update(x, dy, w, slots, args, stats, "adamw", True),
        "triton_jit_dispatch": lambda: fused_update_kernel[grid](*positional, **constexprs, num_warps=4,
                                                                 num_stages=3),
        "compiled_runner": lambda: runner(*every),
        "launch_compiled_again": lambda: again(grid, positional),  # runtime/direct_launch.py where it applies
        "bound_launch": lambda: bound(x, dy, args, stats),
        "bound_rule_pass": lambda: rule_pass(grad, grad, args, stats),
        "torch_add_": lambda: w.add_(0),  # for reference: one small torch op
    }
    if persistent_unsupported(x, dy, w, slots) is None:
        calls["launch_persistent"] = lambda: launch_persistent(x, dy, w, slots, args, stats, RULE_UPDATES["adamw"],
                                                               True)
        persistent = PersistentLaunch(w, slots, stats, RULE_UPDATES["adamw"], True)
        calls["persistent_bound"] = lambda: persistent(x, dy, args, stats)
    costs = {name: per_call_us(fn) for name, fn in calls.items()}
    costs["next_launch_args_in_a_step"] /= LAYERS_A_STEP  # per launch
    print("us per call (host, 64 x 64 layer, 16 tokens):")
    for name, us in costs.items():
        print(f"  {name:24s}{us:8.1f}")
    return costs


def eager_training(model_name: str, state: str, batch: int):
    """An eager forge training step of ``model_name`` (batch x 512 tokens), warmed up."""
    model = build_model(model_name)
    forge_hf.patch_model(model, optimizer="adamw", state_precision=state, lr=1e-5, weight_decay=0.01)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-5, weight_decay=0.01)
    ids = torch.randint(0, model.config.vocab_size, (batch, 512), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def per_layer_host_us(model_name, steps=5, state="bf16") -> dict:
    """Host microseconds per fused layer and step, on a real model's layers in eager training:
    its forward (ForgeLinear.forward) and the Python of its backward (nn/linear.fused_backward),
    timed around those calls with the GPU queue never full (the model is small enough that the
    host leads); and inside the backward, the parts: dX's GEMM, the launch arguments, the
    two-pass weight gradient's GEMM, the rule pass's and the fused kernels' launches."""
    from forge_hf.kernels import dispatch
    from forge_hf.kernels.launch import persistent_launch
    from forge_hf.nn import linear

    step = eager_training(model_name, state, batch=4)
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(kind, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - t
            calls[kind] = calls.get(kind, 0) + 1
            return out
        return wrapper

    patched = [(linear.ForgeLinear, "forward", "forward"), (linear, "fused_backward", "backward"),
               (linear, "input_gradient", "dx_gemm"), (linear, "next_launch_args", "launch_args"),
               (dispatch, "weight_gradient", "two_pass_gemm"), (BoundLaunch, "__call__", "triton_launch"),
               (persistent_launch.PersistentLaunch, "__call__", "persistent_launch")]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, kind in patched:
        setattr(owner, name, timed(kind, getattr(owner, name)))
    token_lookups = [0, 0]  # the persistent kernel's token descriptors: looked up, encoded anew
    find_tokens = persistent_launch.PersistentLaunch._expanded_tokens

    def counted(self, direct, position, t):
        token_lookups[0] += 1
        token_lookups[1] += self.token_key(position, t) not in self._expanded
        return find_tokens(self, direct, position, t)

    persistent_launch.PersistentLaunch._expanded_tokens = counted
    originals.append((persistent_launch.PersistentLaunch, "_expanded_tokens", find_tokens))
    try:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    layers = calls["backward"]  # per fused layer and step: ForgeOptimizer's launches are outside it
    us = {k: spent[k] / (calls["forward"] if k == "forward" else layers) * 1e6 for k in spent}
    parts = ", ".join(f"{k} {v:.1f}" for k, v in us.items() if k not in ("forward", "backward"))
    print(f"persistent kernel token descriptors over the timed steps: {token_lookups[1]} encoded "
          f"of {token_lookups[0]} looked up")
    print(f"{model_name} ({state} state): host us per fused layer and step: forward {us['forward']:.1f}, "
          f"backward {us['backward']:.1f} ({parts}), total {us['forward'] + us['backward']:.1f}")
    return us


def plain_linear_host_us(model_name, tokens=2048) -> dict:
    """Host microseconds of what any linear layer costs, at the model's down_proj shape: an
    nn.Linear forward, and one cuBLAS GEMM of its backward called from Python."""
    _, n_out, n_in, _ = linear_shapes(model_name)[-1 if SHAPES[model_name][1]["tie_word_embeddings"] else -2]
    layer = torch.nn.Linear(n_in, n_out, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        costs = {"nn_linear_forward": per_call_us(lambda: layer(x), n=100),
                 "cublas_gemm": per_call_us(lambda: dy @ layer.weight, n=100)}
    print(f"{model_name} plain linear, host us: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    return costs


@triton.jit
def _no_op(ptr):
    pass


class _BareFusedLinear(torch.autograd.Function):
    """The least a fused layer can do from Python: the forward's GEMM, then in backward dX's
    GEMM and one compiled kernel launch (the weight's update), nothing else."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight
        _BareFusedLinear.launch((1,), [weight])
        return dx, None


def layer_floor_us(model_name, tokens=2048, layers=28, steps=20) -> dict:
    """Host microseconds a layer and step (forward and backward) of a stack of the model's
    down_proj-shaped linears: nn.Linear through autograd's C++ (what fused AdamW's layers
    cost), the bare fused Function above (the floor of any Python autograd Function with the
    same launches), and ForgeLinear."""
    from torch import nn

    _, n_out, n_in, _ = linear_shapes(model_name)[-1 if SHAPES[model_name][1]["tie_word_embeddings"] else -2]
    size = min(n_out, n_in)  # square, so that layers chain
    stacks = {"plain_linear": nn.Sequential(*(nn.Linear(size, size, bias=False) for _ in range(layers)))}
    forged = nn.Sequential(*(nn.Linear(size, size, bias=False) for _ in range(layers)))
    forge_hf.patch_model(forged, optimizer="adamw", state_precision="bf16", lr=1e-5, min_params=0)
    stacks["forge_linear"] = forged
    bare_weights = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) * size**-0.5
                    for _ in range(layers)]
    _BareFusedLinear.launch = launch_compiled(_no_op, (1,), [bare_weights[0]], {}, {})

    def bare(x):
        for w in bare_weights:
            x = _BareFusedLinear.apply(x, w)
        return x

    for name in ("plain_linear", "forge_linear"):
        stacks[name].to("cuda", torch.bfloat16)
    x = torch.randn(tokens, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    runs = {"plain_linear": stacks["plain_linear"], "bare_function": bare, "forge_linear": stacks["forge_linear"]}
    def clear():  # as zero_grad(set_to_none=True) between steps, outside the time
        x.grad = None
        for p in stacks["plain_linear"].parameters():
            p.grad = None

    us = {}
    for _ in range(2):  # interleaved rounds, the best of each
        for name, run in runs.items():
            for _ in range(3):
                run(x).sum().backward()
                clear()
            torch.cuda.synchronize()
            spent = 0.0
            for _ in range(steps):
                t = time.perf_counter()
                run(x).sum().backward()
                spent += time.perf_counter() - t
                clear()
            torch.cuda.synchronize()
            us[name] = min(us.get(name, float("inf")), spent / steps / layers * 1e6)
    print(f"{model_name} {size}x{size} stack at {tokens} tokens, host us a layer and step: "
          + ", ".join(f"{k} {v:.1f}" for k, v in us.items()))
    return us


def profile_training(model_name, steps, lines=35) -> float:
    """Wall ms of an eager forge step (bf16 state, 1 x 512), then a cProfile of ``steps`` more."""
    step = eager_training(model_name, "bf16", batch=1)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    print(f"{model_name}: {wall_ms:.1f} ms per step (wall, no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(lines)
    return wall_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile-lines", type=int, default=35, help="functions shown of the eager step's cProfile")
    add_table_option(ap)
    opts = ap.parse_args()
    costs = launch_costs()
    layer_us = per_layer_host_us(opts.model, opts.steps)
    plain_us = plain_linear_host_us(opts.model)
    floor_us = layer_floor_us(opts.model)
    wall_ms = profile_training(opts.model, opts.steps, opts.profile_lines)
    rows = [dict(model="64x64 layer", batch="1x16", arm=f"host_{name}", step_ms=us / 1e3, tool="host_overhead",
                 note="host time per call") for name, us in costs.items()]
    rows.append(dict(model=opts.model, batch="1x512", arm="forge_bf16", step_ms=wall_ms, tool="host_overhead",
                     note="eager step, wall clock, model's own loss"))
    rows.append(dict(model=opts.model, batch="4x512", arm="host_per_fused_layer", tool="host_overhead",
                     step_ms=(layer_us["forward"] + layer_us["backward"]) / 1e3,
                     note=f"host time per fused layer and step (ms): forward {layer_us['forward'] / 1e3:.4f} + "
                          f"backward {layer_us['backward'] / 1e3:.4f}"))
    rows += [dict(model=opts.model, batch="4x512", arm=f"host_per_fused_layer_{part}", step_ms=us / 1e3,
                  tool="host_overhead", note="host time per fused layer and step, inside its backward")
             for part, us in layer_us.items() if part not in ("forward", "backward")]
    rows += [dict(model=opts.model, batch="1x2048", arm=f"host_{name}", step_ms=us / 1e3, tool="host_overhead",
                  note="host time per call, the model's down_proj shape") for name, us in plain_us.items()]
    rows += [dict(model=opts.model, batch="1x2048", arm=f"host_layer_{name}", step_ms=us / 1e3, tool="host_overhead",
                  note="host time a layer and step, forward and backward, stack of square down_proj-sized linears")
             for name, us in floor_us.items()]
    append_rows(rows, opts.table)


if __name__ == "__main__":
    main()
