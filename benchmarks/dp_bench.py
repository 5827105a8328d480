"""Data-parallel FORGE on real shapes: one process per GPU under torchrun.

    torchrun --standalone --nproc_per_node 2 benchmarks/dp_bench.py --mode parity --out dp_parity.json
    torchrun --standalone --nproc_per_node 2 benchmarks/dp_bench.py --mode speed \
        --models qwen3-1.7b,llama-3.1-8b --arms forge_dp_graphed,ddp_fused_adamw,fsdp2_fused_adamw
    # dry run on CPU (gloo, forge's reference backend): add --device cpu --tiny

parity: W ranks at local batch b against one process at batch W*b, same init and data
(rank 0 runs the single process after the data-parallel run); --graphed: the ranks' steps
are captured and replayed (forge_hf.GraphedStep: 2 eager steps, a capture, replays). Reports the weight
difference (absolute, relative to each tensor's largest weight, in ulps of the weight
dtype), fused and non-fused weights apart, and whether the replicas are bit-identical.
speed: step time and per-rank peak memory of forge_dp (sharded state), DDP + fused AdamW,
FSDP2 + fused AdamW and forge inside FSDP2 (forge_fsdp2; --state for its state), bf16
parameters, batch b x seq per rank; each arm a row of the results table as soon as it is
measured (step: the slowest rank's; peak: the largest rank's), --out also writes every
rank's fields as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import forge_hf
from forge_hf.optim.distributed import enable_data_parallel, row_band
from forge_hf.optim.fsdp import enable_fsdp
from forge_hf.optim.optimizer import fused_layers

from models import SHAPES, build_model
from results_table import add_table_option, append_rows
from timing import profile_steps, step_times, summary

ARMS = ("forge_dp", "ddp_fused_adamw", "fsdp2_fused_adamw", "forge_fsdp2")
# forge_dp_graphed: forge_dp's whole step captured once and replayed (forge_hf.GraphedStep;
# no DDP wrapper: the step averages the non-fused gradients itself)
# forge_plain (no data parallelism at all) is for comparing with forge_dp at world size 1;
# forge_dp_replicated (whole states, no row gathers) separates the row gathers' cost
EXTRA_ARMS = ("forge_dp_graphed", "forge_plain", "forge_dp_replicated")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float32: 23}
CORE_RTOL = 1e-5  # tests/helpers.py's RTOL_FP32: 99.9% of a tensor within it of its largest weight
# hf: the model's own loss (an fp32 copy of the logits); forge: forge_hf.causal_lm_loss
LOSSES = {"hf": lambda model, batch: model(**batch).loss, "forge": forge_hf.causal_lm_loss}
# --tiny: a dry-run size of the same config family (a Qwen3 layer stays a Qwen3 layer)
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)


# ----------------------------------------------------------------------------- setup


def setup(opts):
    """Process group and this rank's device: nccl on GPUs, gloo on CPU."""
    if opts.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)  # before init: nccl and all_gather_object use it
        opts.dev = torch.device("cuda", local)
        dist.init_process_group("nccl")
    else:
        opts.dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_world_size(), dist.get_rank()


def build(opts, name, dtype):
    """models.build_model with --tiny / --layers applied to the config; the same seed on
    every rank and in the single process, so all start from the same weights."""
    overrides = dict(TINY) if opts.tiny else {}
    if opts.layers:
        overrides["num_hidden_layers"] = opts.layers
    return build_model(name, device=opts.dev, dtype=dtype, seed=0, liger=opts.liger, **overrides)


def global_batch(opts, step, size, vocab):
    """The same tokens on every rank (CPU generator seeded per step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (size, opts.seq), generator=gen).to(opts.dev)


def local_slice(ids, rank, b):
    # rank order = token order of the gathered batch = the single process's batch order
    return ids[rank * b:(rank + 1) * b]


def patch(opts, model):
    extra = dict(min_params=0) if opts.tiny else {}  # tiny linears are below the default threshold
    forge_hf.patch_model(model, optimizer="adamw", state_precision=opts.state, rounding=opts.rounding,
                         lr=opts.lr, weight_decay=0.01, **extra)


def forge_optimizer(opts, model):
    return forge_hf.ForgeOptimizer(model, lr=opts.lr, weight_decay=0.01)


def ddp(opts, model):
    return DistributedDataParallel(model, device_ids=[opts.dev.index] if opts.dev.type == "cuda" else None)


def sync(opts):
    if opts.dev.type == "cuda":
        torch.cuda.synchronize()


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write(opts, payload):
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(payload, f, indent=1)


def header(opts, world):
    name = torch.cuda.get_device_name(opts.dev) if opts.dev.type == "cuda" else "cpu"
    args = {k: str(v) if k == "table" else v for k, v in vars(opts).items() if k != "dev"}
    return dict(device=name, torch=torch.__version__, world=world, args=args)


# ----------------------------------------------------------------------------- parity


def train_run(opts, dtype, world, rank):
    """Train with forge for --steps steps; rank None: one process with the global batch.
    Returns the model and the per-step loss (mean over ranks). --optimizer adamw: torch's
    fused AdamW (DDP on the ranks) instead, the control for how far any data-parallel run
    drifts from one process (the model's own GEMMs at another batch size)."""
    model = build(opts, opts.model, dtype)
    vocab = model.config.vocab_size
    runner = model
    if opts.optimizer == "adamw":
        if rank is not None:
            runner = ddp(opts, model)
        opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01,
                                fused=True if opts.dev.type == "cuda" else None)
        return model, train_steps(opts, world, rank, runner, opt, None, vocab)
    patch(opts, model)
    if rank is not None:
        enable_data_parallel(model, mode="sharded")
        runner = None if opts.graphed else ddp(opts, model)
    opt = forge_optimizer(opts, model)
    graphed = forge_hf.GraphedStep(model, opt, loss_fn=LOSSES[opts.loss]) if runner is None else None
    return model, train_steps(opts, world, rank, runner, opt, graphed, vocab)


def train_steps(opts, world, rank, runner, opt, graphed, vocab):
    losses = []
    for step in range(opts.steps):
        ids = global_batch(opts, step, world * opts.batch, vocab)
        if rank is not None:
            ids = local_slice(ids, rank, opts.batch)
        if graphed is not None:
            losses.append(graphed(dict(input_ids=ids, labels=ids)).float())
            continue
        loss = LOSSES[opts.loss](runner, dict(input_ids=ids, labels=ids))
        loss.backward()
        opt.step()  # waits for the sharded row gathers: every rank then holds whole weights
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    if rank is not None:
        dist.all_reduce(losses)  # equal token counts per rank: the mean is the global loss
        losses /= world
    return losses.tolist()


def replica_mismatches(weights, world):
    """Names whose tensor differs from rank 0's on any rank (full-tensor comparison)."""
    bad = []
    for name, w in weights.items():
        ref = w.clone()
        dist.broadcast(ref, 0)
        if not torch.equal(ref, w):
            bad.append(name)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, bad)
    return sorted({n for names in per_rank for n in names})


def diff_stats(got, ref, band0_rows=None):
    """Differences of ``got`` from ``ref``; ulps are those of ref's dtype at |ref|.
    band0_rows: rows [0, n) updated by rank 0 (fused weights), counted apart."""
    a, b = got.float(), ref.float()
    d = (a - b).abs()
    _, exp = torch.frexp(b.abs().clamp_min(torch.finfo(ref.dtype).tiny))
    ulps = d / torch.ldexp(torch.ones_like(b), exp - 1 - MANTISSA_BITS[ref.dtype])
    out = dict(numel=d.numel(), equal=int((d == 0).sum()), max_abs=d.max().item(),
               max_rel=(d.max() / b.abs().max().clamp_min(1e-30)).item(),
               max_ulps=ulps.max().item(), sum_ulps=ulps.sum().item(), over_1ulp=int((ulps > 1).sum()),
               # the core tests' criterion: within 1e-5 of the tensor's largest weight
               within_core=int((d <= CORE_RTOL * b.abs().max()).sum()))
    if band0_rows is not None:
        out.update(band0_numel=d[:band0_rows].numel(), band0_equal=int((d[:band0_rows] == 0).sum()))
    return out


def summarise(rows: dict) -> dict:
    if not rows:
        return {}
    n = sum(r["numel"] for r in rows.values())
    out = dict(tensors=len(rows), numel=n, equal_frac=sum(r["equal"] for r in rows.values()) / n,
               max_abs=max(r["max_abs"] for r in rows.values()),
               max_rel=max(r["max_rel"] for r in rows.values()),
               max_ulps=max(r["max_ulps"] for r in rows.values()),
               mean_ulps=sum(r["sum_ulps"] for r in rows.values()) / n,
               # max_ulps is set by weights near zero (tiny ulp); the share above 1 ulp is the robust one
               over_1ulp_frac=sum(r["over_1ulp"] for r in rows.values()) / n,
               within_core_frac=sum(r["within_core"] for r in rows.values()) / n,
               worst_within_core=min(r["within_core"] / r["numel"] for r in rows.values()),
               worst_rel=sorted(rows, key=lambda k: -rows[k]["max_rel"])[:3])
    if all("band0_numel" in r for r in rows.values()):
        # rows rank 0 updated vs the others: a difference only outside band 0 points at the
        # bands' element indices (the stochastic-rounding stream), not the gradient
        n0 = sum(r["band0_numel"] for r in rows.values())
        e0 = sum(r["band0_equal"] for r in rows.values())
        out.update(band0_equal_frac=e0 / max(n0, 1),
                   other_bands_equal_frac=(sum(r["equal"] for r in rows.values()) - e0) / max(n - n0, 1))
    return out


def parity(opts, world, rank):
    dtype = DTYPES[opts.weights]
    model, dp_losses = train_run(opts, dtype, world, rank)
    band0 = {f"{n}.weight": row_band(m.forge_weight_view().shape[0], m.forge_dp.block_n, world, 0)[1]
             for n, m in fused_layers(model).items() if not m.forge_transposed}
    # the control (--optimizer adamw) reports the same weights apart: the decoder's linears
    fused_names = ({f"{n}.weight" for n in fused_layers(model)} if opts.optimizer == "forge" else
                   {f"{n}.weight" for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}"})
    dp_weights = {k: v.detach().clone() for k, v in model.named_parameters()}  # tied weights once
    del model
    free()
    mismatched = replica_mismatches(dp_weights, world)
    result = dict(header(opts, world), mode="parity", replicas_identical=not mismatched,
                  replica_mismatched=mismatched[:20], dp_loss=dp_losses)
    if rank == 0:  # the other ranks wait at the barrier below
        single, result["single_loss"] = train_run(opts, dtype, world, None)
        rows = {k: diff_stats(dp_weights[k], v.detach(), band0.get(k)) for k, v in single.named_parameters()}
        result["fused"] = summarise({k: r for k, r in rows.items() if k in fused_names})
        result["nonfused"] = summarise({k: r for k, r in rows.items() if k not in fused_names})
        del single
        write(opts, result)
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()


# ----------------------------------------------------------------------------- speed


def fully_shard_fn():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4 / 2.5
    return fully_shard


def shard(opts, model):
    """FSDP2 as the FSDP2 arms use it: one all-gather / reduce-scatter unit per decoder layer,
    then the root (embeddings, final norm, lm_head, tied or not), on a mesh of the run's
    device type (fully_shard's default mesh is on the GPU wherever one is present, also for
    a --device cpu run on gloo, whose collectives then never complete)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_fn()
    mesh = init_device_mesh(opts.dev.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_arm(opts, arm, model):
    """(module to call, optimizer) for ``arm``."""
    fused = True if opts.dev.type == "cuda" else None  # fused AdamW: GPU only here
    if arm in ("forge_dp", "forge_dp_replicated"):
        patch(opts, model)
        # before DDP: it reads the ignore list
        enable_data_parallel(model, mode="sharded" if arm == "forge_dp" else "replicated")
        return ddp(opts, model), forge_optimizer(opts, model)
    if arm == "forge_dp_graphed":
        patch(opts, model)
        enable_data_parallel(model, mode="sharded")
        opt = forge_optimizer(opts, model)
        return forge_hf.GraphedStep(model, opt, loss_fn=LOSSES[opts.loss], warmup_steps=2), opt
    if arm == "forge_plain":
        patch(opts, model)
        return model, forge_optimizer(opts, model)
    if arm == "ddp_fused_adamw":
        return ddp(opts, model), torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01, fused=fused)
    if arm == "fsdp2_fused_adamw":
        shard(opts, model)
        return model, torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.01, fused=fused)
    if arm == "forge_fsdp2":  # forge inside FSDP2 (optim/fsdp.py): the fused layers step their row shards
        patch(opts, model)
        shard(opts, model)
        enable_fsdp(model)
        return model, forge_optimizer(opts, model)
    raise ValueError(f"unknown arm {arm!r}: choose from {ARMS + EXTRA_ARMS}")


def phase_medians(phases, cuda) -> dict:
    """Median host (issuing) and GPU (between the marks) milliseconds of each phase."""
    out = {}
    for i, phase in enumerate(("forward", "backward", "optimizer")):
        out[f"{phase}_host"] = statistics.median((h[i + 1] - h[i]) * 1e3 for _, h in phases)
        if cuda:
            out[f"{phase}_gpu"] = statistics.median(m[i].elapsed_time(m[i + 1]) for m, _ in phases)
    return out


def ablate(kind: str, world: int) -> None:
    """Benchmark-only ablations of the data-parallel layer, to find where its time goes.
    no_announce: token counts taken as equal on every rank (true here: same batch shape),
    never exchanged. local_tokens: no token gather at all, this rank's tokens
    repeated instead: the gradient is wrong, only the timing means anything."""
    from forge_hf.optim import distributed

    if kind == "no_announce":
        distributed.TokenGather.announce = lambda self, t_local: None
        distributed.TokenGather._counts = lambda self, t_local, device: [t_local] * self.world
    elif kind == "local_tokens":
        distributed.TokenGather.announce = lambda self, t_local: None
        distributed.DataParallelFusion.gather_tokens = lambda self, x2, dy2: (
            torch.cat([x2] * world), torch.cat([dy2] * world) / world)
    elif kind != "none":
        raise ValueError(f"unknown ablation {kind!r}")


def run_arm(opts, name, arm, world, rank):
    """This rank's numbers for one (model, arm); a fresh model, freed afterwards."""
    cuda = opts.dev.type == "cuda"
    free()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = dict(rank=rank)
    model = runner = opt = None
    try:
        model = build(opts, name, torch.bfloat16)
        res["params"] = sum(p.numel() for p in model.parameters())
        runner, opt = make_arm(opts, arm, model)
        ids = local_slice(global_batch(opts, 0, world * opts.batch, model.config.vocab_size), rank, opts.batch)
        batch = dict(input_ids=ids, labels=ids)
        graphed = isinstance(runner, forge_hf.GraphedStep)

        phases = []  # per step: host and GPU milliseconds of forward, backward, optimizer

        def step():
            marks, host = [], []
            for phase in ("forward", "backward", "optimizer", None):
                if cuda:
                    marks.append(torch.cuda.Event(enable_timing=True))
                    marks[-1].record()
                host.append(time.perf_counter())
                if graphed:  # the whole step, counted as its forward
                    if phase == "forward":
                        runner(batch)
                elif phase == "forward":
                    loss = LOSSES[opts.loss](runner, batch)
                elif phase == "backward":
                    loss.backward()
                elif phase == "optimizer":
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            phases.append((marks, host))

        for _ in range(opts.warmup):
            step()
        sync(opts)
        phases.clear()
        res.update(status="ok", **summary(step_times(step, opts.steps, cuda=opts.dev.type == "cuda")))
        res["phases_ms"] = phase_medians(phases, cuda)
        if opts.profile and cuda:
            res.update(profile_steps(step))
    except torch.cuda.OutOfMemoryError:
        res.update(status="OOM")
    except Exception as e:  # noqa: BLE001 - a row, so the other arms still run (e.g. FSDP2 on gloo)
        traceback.print_exc()
        res.update(status="error", reason=f"{type(e).__name__}: {str(e)[:500]}")
    finally:
        if cuda:
            res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        model = runner = opt = None
        free()
    return res


def combine(name, arm, per_rank, world, opts):
    """One row from every rank's numbers: the step takes as long as the slowest rank."""
    ok = all(r["status"] == "ok" for r in per_rank)
    row = dict(model=name, arm=arm, status="ok" if ok else next(r["status"] for r in per_rank if r["status"] != "ok"),
               batch_per_rank=opts.batch, seq=opts.seq, per_rank=per_rank)
    if ok:
        row["step_ms"] = max(r["step_ms"] for r in per_rank)
        row["tokens_per_s"] = world * opts.batch * opts.seq / (row["step_ms"] / 1e3)
    if all("peak_gib" in r for r in per_rank):
        row["peak_gib_max"] = max(r["peak_gib"] for r in per_rank)
    reasons = [r["reason"] for r in per_rank if "reason" in r]
    if reasons:
        row["reason"] = reasons[0]
    return row


def table_row(row: dict, world: int, opts) -> dict:
    """The results table's row of one arm; a forge arm's name carries its state precision."""
    spreads = [r["step_ms_q3"] - r["step_ms_q1"] for r in row["per_rank"] if "step_ms_q1" in r]
    setup = [f"{world} ranks, batch per rank", "causal_lm_loss" if opts.loss == "forge" else "the model's loss"]
    if opts.liger:
        setup.append("Liger kernels")
    if opts.ablate != "none":
        setup.append(f"ablation {opts.ablate}")
    if row["status"] != "ok":
        setup.append(f"{row['status']}: {row.get('reason', '')[:200]}")
    return dict(model=row["model"], batch=f"{opts.batch}x{opts.seq}",
                arm=row["arm"] + (f"_{opts.state}" if row["arm"].startswith("forge") else ""),
                step_ms=row.get("step_ms"), spread_ms=max(spreads, default=None), peak_gib=row.get("peak_gib_max"),
                tool="dp_bench", note=", ".join(setup))


def speed(opts, world, rank):
    rows = []
    for name in opts.models.split(","):
        for arm in opts.arms.split(","):
            t0 = time.time()
            mine = run_arm(opts, name, arm, world, rank)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            if rank == 0:
                rows.append(dict(combine(name, arm, per_rank, world, opts), wall_s=time.time() - t0))
                print(json.dumps(rows[-1]), flush=True)
                write(opts, dict(header(opts, world), mode="speed", results=rows))
                if not opts.tiny:  # a dry run's shapes are not the model's
                    append_rows([table_row(rows[-1], world, opts)], opts.table,
                                gpu=f"{world}x {header(opts, world)['device']}")
            dist.barrier()  # the next arm's peak memory starts from freed ranks


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("parity", "speed"), required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES), help="parity mode")
    ap.add_argument("--models", default="qwen3-1.7b,llama-3.1-8b", help="speed mode, comma-separated")
    ap.add_argument("--arms", default=",".join(ARMS), help="speed mode, comma-separated")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the shape's)")
    ap.add_argument("--tiny", action="store_true", help="shrink hidden sizes for a CPU dry run")
    ap.add_argument("--batch", type=int, default=1, help="local batch per rank")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=None, help="parity: training steps (5); speed: timed steps (10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--state", choices=("fp32", "bf16", "int8", "al8"), default="bf16")
    ap.add_argument("--weights", choices=tuple(DTYPES), default="bf16", help="parity mode: parameter dtype")
    ap.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic")
    ap.add_argument("--liger", action="store_true", help="Liger's kernels in every arm (models.apply_liger)")
    ap.add_argument("--loss", choices=tuple(LOSSES), default="hf", help="every arm's loss (see LOSSES)")
    ap.add_argument("--optimizer", choices=("forge", "adamw"), default="forge",
                    help="parity mode: adamw trains with torch's fused AdamW under DDP instead (the control)")
    ap.add_argument("--graphed", action="store_true",
                    help="parity mode: the ranks train with GraphedStep (the single process stays eager)")
    ap.add_argument("--ablate", choices=("none", "no_announce", "local_tokens"), default="none",
                    help="speed mode: a benchmark-only change of forge's data-parallel layer (see ablate)")
    ap.add_argument("--profile", action="store_true", help="speed mode: each rank profiles 3 more steps")
    ap.add_argument("--out", default=None, help="also write the results as JSON (parity mode: its only output)")
    add_table_option(ap)
    opts = ap.parse_args()
    if opts.steps is None:
        opts.steps = 5 if opts.mode == "parity" else 10
    world, rank = setup(opts)
    ablate(opts.ablate, world)
    try:
        (parity if opts.mode == "parity" else speed)(opts, world, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
