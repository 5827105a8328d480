"""Per-step timing shared by the benchmark scripts."""

import statistics
import time

import torch


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
