"""Per-step timing shared by the benchmark scripts."""

import statistics
import time

import torch

FUSED_KERNELS = ("fused_update_kernel", "persistent_update_kernel")  # the Triton and Gluon kernels


def step_times(step, n: int, cuda: bool = True) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``step``: CUDA events on a GPU (the GPU's
    time, launch to finish), wall clock on CPU."""
    times = []
    for _ in range(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def summary(times: list[float]) -> dict:
    """Median step time and its quartiles."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return dict(step_ms=statistics.median(times), step_ms_q1=q[0], step_ms_q3=q[2])


def profile_steps(step, steps=3) -> dict:
    """Per step: GPU time of the fused kernels, GPU time of all kernels (busy time: a step
    much longer than it waits on the host), and the top host and GPU entries."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    per_step = lambda us: us / 1e3 / steps
    top = lambda items, key: [(e.key[:80], round(per_step(key(e)), 3), e.count // steps)
                              for e in sorted(items, key=key, reverse=True)[:12]]
    return dict(
        fused_kernel_ms=per_step(sum(e.self_device_time_total for e in kernels if e.key.startswith(FUSED_KERNELS))),
        gpu_busy_ms=per_step(sum(e.self_device_time_total for e in kernels)),
        top_gpu_ms=top(kernels, lambda e: e.self_device_time_total),
        top_host_self_ms=top([e for e in events if e.device_type == torch.autograd.DeviceType.CPU],
                             lambda e: e.self_cpu_time_total),
    )
