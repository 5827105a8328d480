"""One rank of the data-parallel tests (started by tests/optim/test_distributed.py; gloo on CPU).

reducer "ddp": DDP averages the non-fused gradients, as users train eagerly. reducer
"average": what a graphed step (GraphedStep) runs, without the capture: rank 0's weights
broadcast, the non-fused gradients averaged by forge, and after the first step the token
counts frozen (no count exchange). reducer "graphed": GraphedStep itself, nccl on two GPUs.
reducer "plain_ddp": DDP without enable_data_parallel, without and with find_unused_parameters,
which must stop. reducer "accumulate": gradient accumulation over micro-batches (train_accumulating);
"accumulate_clip" the same clipped at CLIP."""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import forge_hf
from forge_hf import GraphedStep
from forge_hf.optim.distributed import average_gradients, broadcast_parameters, enable_data_parallel
from tests.helpers import tiny_llama as small_llama

VOCAB, SEQ = 128, 8
# trained besides fp32 in the launches of data_parallel="sharded" with DDP: the 4-bit states in bands,
# the embedding on the ordinary path in one process too (its states 16-bit there, 4-bit compact)
SHARDED_PRECISIONS = ("log4", "log4_factored")
PRECISION_STEPS = 3  # their steps: fewer than fp32's, the 4-bit codecs' reference arithmetic is slow on CPU


def tiny_llama():
    return small_llama(VOCAB, hidden=96, intermediate=192)


def global_batch(step, size):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)


def train(world, rank, local_batch, steps, mode, state_precision="fp32", reducer="ddp", device="cpu",
          fuse_embedding="auto"):
    """Train; rank < 0 means one process with the whole global batch. Returns the model
    and its optimizer. On a GPU the fused kernels run compiled (backend "auto")."""
    model = tiny_llama().to(device)
    forge_hf.patch_model(model, optimizer="adamw", state_precision=state_precision,
                         backend="reference" if device == "cpu" else "auto",
                         min_params=0, lr=1e-3, weight_decay=0.01, fuse_embedding=fuse_embedding)
    runner, counts = model, None
    if rank >= 0:
        enable_data_parallel(model, mode=mode)
        if reducer != "ddp" and rank > 0:  # without DDP, rank 0's weights must reach the others
            torch.nn.init.normal_(model.model.embed_tokens.weight)
        if reducer == "graphed":  # GraphedStep broadcasts, averages and freezes the counts itself
            return train_graphed(model, world, rank, local_batch, steps)
        if reducer == "ddp":
            runner = DistributedDataParallel(model)
        else:
            broadcast_parameters(model)
            counts = next(iter(forge_hf.optim.optimizer.fused_layers(model).values())).forge_dp.gather.counts
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        ids = global_batch(step, world * local_batch).to(device)
        if rank >= 0:
            ids = ids[rank * local_batch:(rank + 1) * local_batch]
        with counts.frozen() if counts is not None and step > 0 else contextlib.nullcontext():
            runner(input_ids=ids, labels=ids).loss.backward()
            if counts is not None:
                average_gradients(model)
            opt.step()
        opt.zero_grad()
    return model, opt


MICRO = 2  # micro-batches a step of the "accumulate" reducer


CLIP = 0.05  # the "accumulate_clip" reducer's max_grad_norm: below the gradients' norms, so active


def train_accumulating(world, rank, local_batch, steps, mode, max_grad_norm=0.0):
    """MICRO micro-batches a step, held by the fused layers until the optimizer step (clipped
    at ``max_grad_norm``); DDP reduces the other gradients at the last micro-batch only
    (no_sync before). rank < 0: one process with the whole global micro-batches. The model,
    its optimizer and each step's gradient norm before clipping."""
    model = tiny_llama()
    forge_hf.patch_model(model, optimizer="adamw", backend="reference", min_params=0, lr=1e-3, weight_decay=0.01)
    runner = model
    if rank >= 0:
        enable_data_parallel(model, mode=mode)
        runner = DistributedDataParallel(model)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3, weight_decay=0.01, accumulate=True, max_grad_norm=max_grad_norm)
    norms = []
    for step in range(steps):
        for micro in range(MICRO):
            ids = global_batch(MICRO * step + micro, world * local_batch)
            if rank >= 0:
                ids = ids[rank * local_batch:(rank + 1) * local_batch]
            last = micro == MICRO - 1
            with contextlib.nullcontext() if last or rank < 0 else runner.no_sync():
                (runner(input_ids=ids, labels=ids).loss / MICRO).backward()
        opt.step()
        norms.append(opt.last_grad_norm.item())
        opt.zero_grad()
    opt.norms = norms
    return model, opt


def train_graphed(model, world, rank, local_batch, steps):
    """GraphedStep's data-parallel training: two eager warm-up steps, a capture, replays."""
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3, weight_decay=0.01)
    step = GraphedStep(model, opt, warmup_steps=2)
    for i in range(steps):
        ids = global_batch(i, world * local_batch)[rank * local_batch:(rank + 1) * local_batch].cuda()
        step({"input_ids": ids, "labels": ids})
    assert step.graph is not None, "the steps after the warm-up were not replayed"
    return model, opt


def stop_without_data_parallel(world, rank, local_batch, steps, find_unused):
    """DDP over a patched model without enable_data_parallel: the step and message it stops
    with, and whether every weight was still as it started."""
    model = tiny_llama()
    forge_hf.patch_model(model, optimizer="adamw", backend="reference", min_params=0, lr=1e-3)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runner = DistributedDataParallel(model, find_unused_parameters=find_unused)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-3)
    for step in range(steps):
        ids = global_batch(step, world * local_batch)[rank * local_batch:(rank + 1) * local_batch]
        try:
            runner(input_ids=ids, labels=ids).loss.backward()
        except RuntimeError as error:
            unchanged = all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
            return dict(stopped_at=step, error=str(error), unchanged=unchanged)
        opt.step()
        opt.zero_grad()
    return dict(stopped_at=None, error=None, unchanged=False)


def summary(model, opt, rank):
    """What the test reads of a trained rank: weights, states' bytes, bytes sent, rank 0's
    gathered optimizer state (loadable by one process)."""
    fused = forge_hf.optim.optimizer.fused_layers(model)
    sent = sum(m.forge_dp.bytes_sent for m in fused.values())  # before state_dict's gathers
    full_state = opt.state_dict()  # gathers shards: every rank calls it
    return dict(weights={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                norms=getattr(opt, "norms", None), state_bytes=sum(m.forge_state.nbytes() for m in fused.values()),
                bytes_sent=sent, optimizer=full_state if rank == 0 else None)


def main(rank, world, init_file, out_dir, mode, local_batch, steps, reducer):
    if reducer == "graphed":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if reducer == "plain_ddp":  # both settings in one launch: a launch costs more than the runs
        result = {find_unused: stop_without_data_parallel(world, rank, local_batch, steps, find_unused)
                  for find_unused in (False, True)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
        return
    if reducer.startswith("accumulate"):
        clip = CLIP if reducer == "accumulate_clip" else 0.0
        model, opt = train_accumulating(world, rank, local_batch, steps, mode, max_grad_norm=clip)
    else:
        model, opt = train(world, rank, local_batch, steps, mode, reducer=reducer,
                           device="cuda" if reducer == "graphed" else "cpu")
    result = summary(model, opt, rank)
    if mode == "sharded" and reducer == "ddp":  # in the same launch: a launch costs more than a run
        result["precisions"] = {p: summary(*train(world, rank, local_batch, PRECISION_STEPS, mode, state_precision=p,
                                                  fuse_embedding="false"), rank)
                                for p in SHARDED_PRECISIONS}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    main(rank, world, sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), sys.argv[8])
