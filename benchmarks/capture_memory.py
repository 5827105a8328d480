"""What is alive at the peak of a graphed step's capture, against the eager step's peak.

Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history)
over one eager step and over the capture of forge's GraphedStep (Llama-3.1-8B shape, 1 x
512, Liger's kernels without its cross-entropy, causal_lm_loss, recompute_swiglu, as in
run_grid.py), replays each trace to find the moment of most allocated bytes, and groups the
allocations alive then by the innermost frame of this project, transformers or Liger
(else torch's). Each phase's peak is a row of the results table (arm forge_STATE_eager,
_capture, _replay); --out writes the sites alive at each peak as JSON.

    python benchmarks/capture_memory.py --state int8 --out capture_int8.json
"""

import argparse
import collections
import json

import torch

from models import build_model
from results_table import add_table_option, append_rows
from run_grid import make_optimizer

OWN = ("forge_hf/", "transformers/", "liger_kernel/", "benchmarks/")


def _site(frames) -> str:
    for f in frames or ():
        if any(k in f["filename"] for k in OWN):
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    f = (frames or [{}])[0]
    return f"{f.get('filename', '?').split('site-packages/')[-1]}:{f.get('line', '?')} {f.get('name', '?')}"


def live_at_peak(trace) -> tuple[int, dict]:
    """(bytes allocated at the trace's peak, {site: bytes alive then}) of the events
    recorded; blocks allocated before recording are not in the trace."""
    (peak,) = peaks_by_step(trace, [len(trace)], tag=False)
    return peak


def peaks_by_step(trace, ends, tag: bool = True) -> list[tuple[int, dict]]:
    """For each step, the events from the previous index of ``ends`` to its own: (bytes
    allocated at the step's peak, counted from the trace's start, {site: bytes alive then}),
    each site prefixed with the step that allocated it (``step 0: ...``) when ``tag``."""
    live, now, start, peaks = {}, 0, 0, []
    for step, end in enumerate(ends):
        best, best_live = now, dict(live)
        for e in trace[start:end]:
            if e["action"] == "alloc":
                site = _site(e.get("frames"))
                live[e["addr"]] = (e["size"], f"step {step}: {site}" if tag else site)
                now += e["size"]
                if now > best:
                    best, best_live = now, dict(live)
            elif e["action"] == "free_requested" and e["addr"] in live:
                now -= live.pop(e["addr"])[0]
        sites = collections.Counter()
        for size, site in best_live.values():
            sites[site] += size
        peaks.append((best, dict(sites.most_common(25))))
        start = end
    return peaks


def recorded(fn):
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [e for t in snap["device_traces"] for e in t]
    extra, sites = live_at_peak(trace)
    return dict(allocated_before_gib=base / 2**30, peak_gib=peak / 2**30, traced_peak_over_start_gib=extra / 2**30,
                sites_mib={k: round(v / 2**20, 1) for k, v in sites.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--state", default="bf16", choices=["bf16", "int8"])
    ap.add_argument("--out", default=None, help="also write the allocation sites alive at each peak as JSON")
    add_table_option(ap)
    opts = ap.parse_args()
    import forge_hf

    model = build_model(opts.model, liger=True, liger_ce=False)
    opt = make_optimizer(f"forge_{opts.state}_graphed", model, recompute_swiglu=True)
    data = torch.randint(0, model.config.vocab_size, (1, 512), device="cuda")
    batch = dict(input_ids=data, labels=data)
    step = forge_hf.GraphedStep(model, opt, forge_hf.causal_lm_loss, warmup_steps=2)
    step(batch)  # states allocated, kernels compiled
    result = dict(model=opts.model, state=opts.state, eager=recorded(lambda: step(batch)),
                  capture=recorded(lambda: step(batch)), replay=recorded(lambda: step(batch)))
    print(json.dumps(result, indent=1))
    note = "Liger kernels, not its cross-entropy, causal_lm_loss, recompute_swiglu; a process of its own"
    append_rows([dict(model=opts.model, batch="1x512", arm=f"forge_{opts.state}_{phase}",
                      peak_gib=result[phase]["peak_gib"], tool="capture_memory", note=note)
                 for phase in ("eager", "capture", "replay")], opts.table)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
