"""The persistent Gluon kernel against fused_update.py's, AdamW with bf16 and int8 state.

Agreement: one step from the same weights, states and arguments by both kernels; the
gradient's fp32 sums may differ in order, so the report counts equal bf16 words and the
largest difference in ulps. Speed: GPU time (CUDA-graph replays) per Llama-3.1-8B shape at
512 tokens and model sums, with the persistent kernel's ablations (main loop only,
epilogue only). Usage: python benchmarks/persistent_probe.py [--out F]
"""
import argparse
import json

import torch
import triton

from forge_hf.kernels.fused_update import RULE_UPDATES, default_config, launch_fused_update
from forge_hf.kernels.persistent_launch import launch_persistent, persistent_unsupported
from forge_hf.kernels.persistent_update import EPILOGUE_ONLY, MAINLOOP_ONLY
from forge_hf.rules import get_rule, make_group
from forge_hf.state import ForgeState
from forge_hf.step_args import pack_args

from kernel_microbench import LLAMA8B, ceilings

ADAMW = RULE_UPDATES["adamw"]


def gpu_time(fn):
    """Median ms of fn replayed in a CUDA graph: GPU time without the host's launch cost
    (a training step runs graphed)."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def setup(n, k, t, precision="bf16", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-3, weight_decay=0.1))
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, group)
    for s in state.kernel_slots():
        if isinstance(s, torch.Tensor):
            s.copy_(torch.rand(n, k, device="cuda", generator=g) * 1e-4)
        elif s is not None:
            s.write(torch.rand(n, k, device="cuda", generator=g) * 1e-4)
    host = rule.host_init()
    for _ in range(3):
        prepared = rule.prepare(group, host)
    return x, dy, w, state.kernel_slots(), pack_args(prepared, host["step"], 1234, "cuda")


def triton_kernel(x, dy, w, slots, args, stats):
    launch_fused_update(x, dy, w, slots, args, stats, "adamw", True, blocks=default_config(*w.shape, x.shape[0])["blocks"])


def check(n, k, t, precision):
    out, stats = {}, {}
    for kernel in ("triton", "persistent"):
        x, dy, w, slots, args = setup(n, k, t, precision)
        assert persistent_unsupported(x, dy, w, slots) is None
        stats[kernel] = torch.zeros(2, device="cuda")
        if kernel == "triton":
            triton_kernel(x, dy, w, slots, args, stats[kernel])
        else:
            launch_persistent(x, dy, w, slots, args, stats[kernel], ADAMW, True)
        torch.cuda.synchronize()
        out[kernel] = [w] + [getattr(s, "codes", s) for s in slots[:2]] + [s.meta for s in slots[:2] if hasattr(s, "meta")]
    result = {}
    for name, a, b in zip(["w", "m", "v", "m_scales", "v_scales"], out["triton"], out["persistent"]):
        result[name] = dict(equal=float((a == b).float().mean()))
    result["stats"] = [stats["triton"].tolist(), stats["persistent"].tolist()]
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    result = dict(checks={}, rows=[])
    for precision in ("bf16", "int8"):
        for n, k, t in [(256, 320, 500), (4096, 4096, 512), (1024, 4096, 100)]:
            key = f"{precision} {n}x{k}x{t}"
            result["checks"][key] = check(n, k, t, precision)
            print(key, result["checks"][key], flush=True)
    bw, flops = ceilings()
    arms = {"triton": ("bf16", None), "persistent": ("bf16", 0), "persistent_mainloop_only": ("bf16", MAINLOOP_ONLY),
            "persistent_epilogue_only": ("bf16", EPILOGUE_ONLY), "triton_int8": ("int8", None),
            "persistent_int8": ("int8", 0)}
    totals = dict.fromkeys(arms, 0.0)
    floor_total = floor_int8 = 0.0
    for name, n, k, count in LLAMA8B:
        row = dict(shape=name, n=n, k=k, count=count)
        for arm, (precision, ablate) in arms.items():
            x, dy, w, slots, args = setup(n, k, 512, precision)
            stats = torch.zeros(2, device="cuda")
            if ablate is None:
                row[arm] = gpu_time(lambda: triton_kernel(x, dy, w, slots, args, stats))
            else:
                row[arm] = gpu_time(lambda: launch_persistent(x, dy, w, slots, args, stats, ADAMW, True, ablate))
            totals[arm] += row[arm] * count
        moved = 2 * 512 * (n + k) + 12 * n * k
        row["floor"] = max(moved / bw, 2 * 512 * n * k / flops) * 1e3
        # int8: two slots of codes read and written (4 bytes) and their fp32 scales, one per 64 (0.25)
        row["floor_int8"] = max((2 * 512 * (n + k) + (4 + 4 + 0.25) * n * k) / bw, 2 * 512 * n * k / flops) * 1e3
        floor_total += row["floor"] * count
        floor_int8 += row["floor_int8"] * count
        result["rows"].append(row)
        print({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    result.update(totals_ms=totals, floor_ms=floor_total, floor_int8_ms=floor_int8, bandwidth=bw, matmul_flops=flops)
    print("model sums (ms):", {key: round(v, 2) for key, v in totals.items()},
          "floor", round(floor_total, 2), "int8 floor", round(floor_int8, 2))
    print("percent of floor:", {key: round(100 * (floor_int8 if "int8" in key else floor_total) / v, 1)
                                for key, v in totals.items()})
    if opts.out:
        json.dump(result, open(opts.out, "w"), indent=1)


if __name__ == "__main__":
    main()
