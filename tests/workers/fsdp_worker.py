"""One rank of the FSDP2 tests (started by tests/optim/test_fsdp.py; gloo on CPU): every case of
CASES in one launch, each trained STEPS steps under fully_shard, checkpointed, stepped once
more, and resumed from the checkpoint in a fresh sharded model for that last step.

A case is (model, weight dtype, state precision):
* "mlp": three biased linears of odd sizes with GELUs and a mean squared error, fp32
  weights: fused weights, and biases through FSDP2's reduce-scatter;
* "exact": one bias-free linear fed directly with exactly summable tokens and output
  gradients (tests/helpers.exact_inputs), whose weight gradient does not depend on
  summation order: a band must then give the single process's bits.

ACCUMULATE_CASES train the same models with gradient accumulation, clipped or not.
run_embedding trains an input embedding (a padding index, rows seen and unseen) before a
fused linear, for the test against torch.optim.AdamW in one process.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import forge_hf
from forge_hf.optim.fsdp import load_sharded_optimizer, save_sharded_optimizer
from forge_hf.optim.optimizer import fused_layers
from tests.helpers import exact_inputs

STEPS, LOCAL_BATCH, SEQ = 3, 2, 3
MLP_SIZES = (13, 23, 17, 5)
EXACT_IN, EXACT_OUT = 40, 70  # rows over two or three ranks, across a 64-row tile
# (kind, weight dtype, state precision, rule): every state precision with AdamW, every rule
# with bf16 weights and states (stochastic rounding) on the exactly summable layer
RULES = ("adagrad", "lion", "nadam", "radam", "rmsprop", "sgd")
PRECISIONS = ("fp32", "bf16", "int8", "al8", "log4", "log4_factored")
CASES = [("mlp", torch.float32, p, "adamw") for p in PRECISIONS] + \
        [("exact", torch.bfloat16, p, "adamw") for p in PRECISIONS] + \
        [("exact", torch.float32, "fp32", "adamw")] + [("exact", torch.bfloat16, "bf16", r) for r in RULES]
RULE_OPTIONS = {"sgd": dict(momentum=0.9), "rmsprop": dict(momentum=0.9, centered=True)}  # all their states


def build(kind, dtype, precision, rule="adamw"):
    """The case's model, patched (fused layers, plain torch elsewhere), as one process starts it."""
    torch.manual_seed(0)
    if kind == "mlp":
        a, b, c, d = MLP_SIZES
        model = nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.GELU(), nn.Linear(c, d))
    else:
        model = nn.Sequential(nn.Linear(EXACT_IN, EXACT_OUT, bias=False))
    model.to(dtype)
    forge_hf.patch_model(model, optimizer=rule, state_precision=precision, backend="reference",
                         min_params=0, lr=1e-2, weight_decay=0.01, **RULE_OPTIONS.get(rule, {}))
    return model


def batch(kind, step, size, dtype):
    """Step ``step``'s global batch of ``size`` rows: (inputs, targets) for "mlp", (tokens,
    output gradient) for "exact"."""
    gen = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return torch.randn(size, SEQ, MLP_SIZES[0], generator=gen), torch.randn(size, SEQ, MLP_SIZES[-1], generator=gen)
    return exact_inputs((size, SEQ, EXACT_IN), EXACT_OUT, dtype=dtype, generator=gen)


def train_step(model, opt, kind, step, dtype, world, rank):
    """One step on this rank's rows of the global batch (rank < 0: one process, all of it).
    Each rank's loss is a mean over its own rows, as under FSDP2; "exact" feeds world x its
    output gradient, which the token gather divides by the world size again, exactly."""
    x, t = batch(kind, step, max(world, 1) * LOCAL_BATCH, dtype)
    if rank >= 0:
        x, t = x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    if kind == "mlp":
        ((model(x) - t) ** 2).mean().backward()
    else:
        model(x).backward(t * world if rank >= 0 else t)
    opt.step()
    opt.zero_grad()


MICRO = 2  # micro-batches an accumulated step
CLIP = 0.05  # below the "mlp" gradients' norms: the clip is active at every step
# (kind, weight dtype, state precision, max_grad_norm): accumulated steps, clipped or not; the
# exactly summable layer unclipped (a norm summed over ranks rounds otherwise than one process's)
ACCUMULATE_CASES = [("mlp", torch.float32, "fp32", 0.0), ("mlp", torch.float32, "fp32", CLIP),
                    ("mlp", torch.float32, "al8", CLIP), ("exact", torch.bfloat16, "bf16", 0.0),
                    ("exact", torch.bfloat16, "log4", 0.0), ("mlp", torch.float32, "log4_factored", CLIP)]


def train_accumulating(model, kind, dtype, world, rank, max_grad_norm):
    """STEPS steps of MICRO micro-batches each, the fused layers holding their gradient until
    the optimizer step (clipped at ``max_grad_norm``); rank < 0: one process with the whole global
    micro-batches. Under FSDP2 (rank >= 0) the other
    gradients reduce-scattered at the last micro-batch only, as accelerate's no_sync does
    (set_requires_gradient_sync). Returns each step's gradient norm before clipping."""
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01, accumulate=True, max_grad_norm=max_grad_norm)
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x, t = batch(kind, MICRO * step + micro, max(world, 1) * LOCAL_BATCH, dtype)
            if rank >= 0:
                x, t = x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
                model.set_requires_gradient_sync(micro == MICRO - 1)
            if kind == "mlp":
                (((model(x) - t) ** 2).mean() / MICRO).backward()
            else:
                model(x).backward(t * world if rank >= 0 else t)
        opt.step()
        norms.append(opt.last_grad_norm.item())
        opt.zero_grad()
    return norms


def run_accumulating(kind, dtype, precision, max_grad_norm, world, rank):
    model = shard(build(kind, dtype, precision), kind)
    norms = train_accumulating(model, kind, dtype, world, rank, max_grad_norm)
    return dict(weights=whole(model), norms=norms,
                no_fused_grad=all(m.weight.grad is None for m in fused_layers(model).values()))


def shard(model, kind):
    # a CPU mesh: fully_shard's default mesh is on the GPU where one is present
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def whole(model) -> dict:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def run_case(kind, dtype, precision, rule, world, rank, out_dir):
    model = shard(build(kind, dtype, precision, rule), kind)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
    no_fused_grad = True
    for step in range(STEPS):
        train_step(model, opt, kind, step, dtype, world, rank)
        no_fused_grad &= all(m.weight.grad is None for m in fused_layers(model).values())
    checkpoint = whole(model), opt.state_dict()
    dcp_dir = None
    if precision.startswith("log4"):  # each rank's rows through DCP (a factored moment's column sums whole)
        dcp_dir = os.path.join(out_dir, f"dcp-{kind}-{precision}-{rule}")
        save_sharded_optimizer(opt, dcp_dir)
    state_bytes = sum(m.forge_state.nbytes() for m in fused_layers(model).values())
    sent = sum(m.forge_dp.bytes_sent for m in fused_layers(model).values())
    train_step(model, opt, kind, STEPS, dtype, world, rank)
    final = whole(model)

    # resume: whole weights into a fresh model, sharded, then the whole optimizer state
    resumed = build(kind, dtype, precision, rule)
    resumed.load_state_dict(checkpoint[0])
    resumed = shard(resumed, kind)
    resumed_opt = forge_hf.ForgeOptimizer(resumed, lr=1e-2, weight_decay=0.01)
    resumed_opt.load_state_dict(checkpoint[1])
    train_step(resumed, resumed_opt, kind, STEPS, dtype, world, rank)
    resumed_dcp = None
    if dcp_dir is not None:
        again = build(kind, dtype, precision, rule)
        again.load_state_dict(checkpoint[0])
        again = shard(again, kind)
        again_opt = forge_hf.ForgeOptimizer(again, lr=1e-2, weight_decay=0.01)
        load_sharded_optimizer(again_opt, dcp_dir)
        train_step(again, again_opt, kind, STEPS, dtype, world, rank)
        resumed_dcp = whole(again)
    return dict(weights=checkpoint[0], optimizer=checkpoint[1], final=final, resumed=whole(resumed),
                resumed_dcp=resumed_dcp, no_fused_grad=no_fused_grad, state_bytes=state_bytes, bytes_sent=sent)


def keep_gathered_weight_refused(world, rank):
    """set_reshard_after_backward(False) would hide the step from the next forward: the
    fused step must stop with the message."""
    model = shard(build("exact", torch.float32, "fp32"), "exact")
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2)
    model.set_reshard_after_backward(False, recurse=True)
    try:
        train_step(model, opt, "exact", 0, torch.float32, world, rank)
    except RuntimeError as error:
        return str(error)
    return None


EMBED_VOCAB, EMBED_DIM, EMBED_OUT, PAD = 24, 8, 6, 0
EMBED_SEEN = 10  # ids drawn below it (the padding index among them): the rows above are never seen


def build_embedding(patched, fuse_embedding="auto"):
    """An input embedding with a padding index before a bias-free linear: fused and patched
    (``patched``), or plain for torch.optim.AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(EMBED_VOCAB, EMBED_DIM, padding_idx=PAD),
                          nn.Linear(EMBED_DIM, EMBED_OUT, bias=False))
    if patched:
        forge_hf.patch_model(model, optimizer="adamw", state_precision="fp32", backend="reference", min_params=0,
                             lr=1e-2, weight_decay=0.01, fuse_embedding=fuse_embedding)
    return model


def embedding_batch(step, world):
    """Step ``step``'s global (ids, targets)."""
    gen = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, EMBED_SEEN, (world * LOCAL_BATCH, SEQ), generator=gen)
    return ids, torch.randn(world * LOCAL_BATCH, SEQ, EMBED_OUT, generator=gen)


def embedding_step(model, opt, step, world, rank):
    """One step on this rank's rows of the global batch (rank < 0: all of it), a mean
    squared error over each rank's own rows."""
    ids, target = embedding_batch(step, world)
    if rank >= 0:
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        ids, target = ids[mine], target[mine]
    ((model(ids) - target) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def run_embedding(world, rank):
    """STEPS steps under FSDP2; and what fuse_embedding=true says under it."""
    model = shard(build_embedding(True), "embed")
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        embedding_step(model, opt, step, world, rank)
    refused = None
    try:
        forge_hf.ForgeOptimizer(shard(build_embedding(True, "true"), "embed"), lr=1e-2)
    except ValueError as error:
        refused = str(error)
    return dict(weights=whole(model), path=type(model[0]).__name__, off=getattr(model[0], "forge_off_reason", None),
                refused=refused)


def main(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {case: run_case(*case, world, rank, out_dir) for case in CASES}
    results["refused"] = keep_gathered_weight_refused(world, rank)
    results["embedding"] = run_embedding(world, rank)
    results["accumulated"] = {case: run_accumulating(*case, world, rank) for case in ACCUMULATE_CASES}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
