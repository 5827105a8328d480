"""One rank of the tensor-parallel tests (started by tests/optim/test_tensor_parallel.py; gloo on
CPU): every case in one launch, results in ``rank<r>.pt``.

* CASES: the tiny Llama of ``model_dir`` loaded with ``tp_plan="auto"`` (colwise q/k/v/gate/up and
  lm_head, rowwise o/down, a vocabulary-sharded embedding), patched, STEPS steps of ``train``
  with a rule, clipped or not, accumulated or not; the gathered weights and norms.
* "plain": the same model unpatched under torch.optim.AdamW (TP's own round-off).
* "resume": STEPS - 1 steps, a checkpoint (DCP: the model's and the optimizer's pieces; and
  the optimizer's gathered state_dict), one more step; then fresh models resumed from each
  checkpoint take that step.
* "bits": one bf16 linear sharded by torch's ColwiseParallel / RowwiseParallel, stepped once with
  exactly summable tokens: its gathered weight, against the unsharded layer's in the test.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import forge_hf
from forge_hf.optim.fsdp import load_sharded_optimizer, save_sharded_optimizer
from forge_hf.optim.optimizer import default_decay_parameter_names, fused_layers
from forge_hf.optim.tensor_parallel import MeshShards
from tests.helpers import exact_inputs

STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 512
LR = 1e-3
RULE_OPTIONS = {"sgd": dict(momentum=0.9), "rmsprop": dict(momentum=0.9, centered=True)}
CLIP = 1.0  # below the tiny Llama's gradient norms (~5): the clip is active at every step
# (rule, max_grad_norm, micro-batches a step)
CASES = [(rule, 0.0, 1) for rule in ("adamw", "adagrad", "lion", "nadam", "radam", "rmsprop", "sgd")] + \
        [("adamw", CLIP, 1), ("adamw", 0.0, 2), ("adamw", CLIP, 2)]
BITS_IN, BITS_OUT = 72, 136  # rows and columns over 2 or 4 ranks, across 64-wide tiles
BITS_CASES = [("colwise", "stochastic"), ("colwise", "nearest"), ("rowwise", "nearest"), ("packed_colwise", "nearest")]


def load(model_dir, tp: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **({"tp_plan": "auto"} if tp else {}))


def patch(model, rule):
    return forge_hf.patch_model(model, optimizer=rule, backend="reference", min_params=0, **RULE_OPTIONS.get(rule, {}))


def forge_optimizer(model, max_grad_norm, micro):
    return forge_hf.ForgeOptimizer(model, lr=LR, weight_decay=0.01, max_grad_norm=max_grad_norm, accumulate=micro > 1)


def torch_adamw(model):
    decay = set(default_decay_parameter_names(model))
    named = list(model.named_parameters())
    return torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
                              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=LR)


def batch(step):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def train(model, opt, steps, micro=1, first=0):
    """``steps`` optimizer steps of ``micro`` micro-batches each (every rank the same batch:
    tensor parallelism splits the layers, not the data); each step's gradient norm."""
    norms = []
    for step in range(first, first + steps):
        for m in range(micro):
            ids = batch(micro * step + m)
            (model(input_ids=ids, labels=ids).loss / micro).backward()
        opt.step()
        norm = getattr(opt, "last_grad_norm", None)
        norms.append(None if norm is None else norm.item())
        opt.zero_grad()
    return norms


def whole(model) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def run_case(model_dir, rule, max_grad_norm, micro):
    model = load(model_dir, tp=True)
    report = patch(model, rule)
    opt = forge_optimizer(model, max_grad_norm, micro)
    norms = train(model, opt, STEPS, micro)
    layers = fused_layers(model).values()
    return dict(weights=whole(model), norms=norms, fused=len(report.fused), skipped=len(report.skipped),
                state_bytes=sum(m.forge_state.nbytes() for m in layers),
                no_fused_grad=all(m.weight.grad is None for m in layers), optimizer=opt.state_dict())


def run_plain(model_dir):
    model = load(model_dir, tp=True)
    train(model, torch_adamw(model), STEPS)
    return whole(model)


def run_resume(model_dir, out_dir):
    import torch.distributed.checkpoint as dcp

    model = load(model_dir, tp=True)
    patch(model, "adamw")
    opt = forge_optimizer(model, CLIP, 1)
    train(model, opt, STEPS - 1)
    checkpoint = os.path.join(out_dir, "checkpoint")
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(checkpoint, "model"))
    save_sharded_optimizer(opt, os.path.join(checkpoint, "optimizer"))
    weights, gathered = whole(model), copy.deepcopy(opt.state_dict())  # whole states are the live slots
    train(model, opt, 1, first=STEPS - 1)
    straight = whole(model)

    resumed = {}
    for how in ("dcp", "gathered"):
        model = load(model_dir, tp=True)
        patch(model, "adamw")
        opt = forge_optimizer(model, CLIP, 1)
        if how == "dcp":
            state = model.state_dict()
            dcp.load(state, checkpoint_id=os.path.join(checkpoint, "model"))
            load_sharded_optimizer(opt, os.path.join(checkpoint, "optimizer"))
        else:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    full = weights[name]
                    if isinstance(p, DTensor):
                        from forge_hf.optim.tensor_parallel import MeshShards

                        full = MeshShards(p).shard_rows(full, full.shape[0])
                        p = p.to_local()
                    p.copy_(full)
            opt.load_state_dict(gathered)
        train(model, opt, 1, first=STEPS - 1)
        resumed[how] = whole(model)
    return dict(straight=straight, resumed=resumed)


def run_unpatch(model_dir):
    """The forward of a fused q_proj, and of the plain one unpatch_model gives back."""
    model = load(model_dir, tp=True)
    patch(model, "adamw")
    fused = type(model.model.layers[0].self_attn.q_proj.__dict__["forward"]).__name__
    forge_hf.unpatch_model(model)
    return fused, model.model.layers[0].self_attn.q_proj.__dict__["forward"].__qualname__


TP_PLAN = {**{f"self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
           **{f"mlp.{p}": "colwise" for p in ("gate_proj", "up_proj")},
           "self_attn.o_proj": "rowwise", "mlp.down_proj": "rowwise"}


def two_d_batch(step, dp_rank=None):
    """Step ``step``'s global batch of two data-parallel ranks (their rows: ``dp_rank``'s)."""
    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=torch.Generator().manual_seed(200 + step))
    return ids if dp_rank is None else ids[dp_rank * BATCH:(dp_rank + 1) * BATCH]


def train_two_d(model, opt, dp_rank=None):
    norms = []
    for step in range(STEPS):
        ids = two_d_batch(step, dp_rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        norms.append(opt.last_grad_norm.item())
        opt.zero_grad()
    return norms


def run_two_d(model_dir, max_grad_norm):
    """TP inside FSDP2 on a (dp 2, tp 2) mesh: torch's ColwiseParallel / RowwiseParallel on each
    decoder layer (transformers' Llama plan), patch_model, then fully_shard over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = load(model_dir, tp=False)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {name: styles[style]() for name, style in TP_PLAN.items()})
    report = patch(model, "adamw")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = forge_optimizer(model, max_grad_norm, 1)
    norms = train_two_d(model, opt, mesh["dp"].get_local_rank())
    return dict(weights=whole(model), norms=norms, fused=len(report.fused),
                modes={m.forge_dp.mode for m in fused_layers(model).values()})


SP_SIZES = (16, 40)  # (features, hidden) of the sequence-parallel block


def sequence_parallel_block():
    torch.manual_seed(0)
    features, hidden = SP_SIZES
    return torch.nn.Sequential(torch.nn.LayerNorm(features), torch.nn.Linear(features, hidden), torch.nn.GELU(),
                               torch.nn.Linear(hidden, features))


def sp_batch(step):
    return torch.randn(2, 8, SP_SIZES[0], generator=torch.Generator().manual_seed(300 + step))


def run_sequence_parallel():
    """torch's sequence parallelism: a LayerNorm on this rank's positions (SequenceParallel), the
    colwise linear gathering them (input Shard(1)), the rowwise one reduce-scattering its output
    back to them; each rank's loss its positions' sum. Clipped, STEPS steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    model = sequence_parallel_block()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                                     "3": RowwiseParallel(output_layouts=Shard(1))})
    report = forge_hf.patch_model(model, backend="reference", min_params=0)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    norms = []
    for step in range(STEPS):
        x = sp_batch(step).chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
        model(x).square().sum().backward()
        opt.step()
        norms.append(opt.last_grad_norm.item())
        opt.zero_grad()
    return dict(weights=whole(model), norms=norms, fused=report.fused_names)


def _packed_colwise(model, mesh):
    """transformers' packed_colwise on ``model[0]`` (a fused gate/up projection's style, bias-free): the
    weight split as two packed halves (_StridedShard), the plan's forward installed."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.tensor_parallel import PackedColwiseParallel

    layer, style = model[0], PackedColwiseParallel()
    placement = _StridedShard(0, split_factor=style.split_factor)
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [placement]))
    style.install_forward(layer, mesh)
    return _StridedShard(-1, split_factor=style.split_factor)


def run_bits(style, rounding):
    """One bf16 linear under torch's ``style`` (or transformers' packed_colwise) on this rank's
    mesh, stepped once from exactly summable tokens (every rank the whole batch; the output
    gradient as the style lays it out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(BITS_IN, BITS_OUT, bias=style != "packed_colwise"))
    model.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if style == "packed_colwise":
        output_placement = _packed_colwise(model, mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel() if style == "colwise" else RowwiseParallel()})
    report = forge_hf.patch_model(model, optimizer="adamw", state_precision="bf16", rounding=rounding,
                                  backend="reference", min_params=0, lr=1e-2, weight_decay=0.01)
    x, dy = exact_inputs((2, 3, BITS_IN), BITS_OUT, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(7))
    world, rank = dist.get_world_size(), dist.get_rank()
    if style == "colwise":  # the input replicated; the local output is this rank's columns (torch.chunk's)
        model(x).backward(dy.chunk(world, dim=-1)[rank])
    elif style == "packed_colwise":  # the local output: this rank's columns of each packed half
        model(x).backward(distribute_tensor(dy, mesh, [output_placement]).to_local())
    else:  # the input given as this rank's columns; the output replicated
        model(x.chunk(world, dim=-1)[rank]).backward(dy)
    layer = model[0]
    # gathered as a checkpoint gathers states (full_tensor() fails on packed halves under torch 2.11)
    shards = MeshShards(layer.weight)
    return dict(fused=len(report.fused), weight=shards.gather_rows(layer.weight.to_local(), BITS_OUT),
                exp_avg=shards.gather_rows(layer.forge_state.slots[0], BITS_OUT),
                bias_grad=None if layer.bias is None else layer.bias.grad.full_tensor())


def main(rank, world, init_file, out_dir, model_dir):
    # transformers sizes the tp_plan's mesh by the launcher's variables
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {case: run_case(model_dir, *case) for case in CASES}
    results["plain"] = run_plain(model_dir)
    results["resume"] = run_resume(model_dir, out_dir)
    results["forwards"] = run_unpatch(model_dir)
    results["sequence_parallel"] = run_sequence_parallel()
    if world == 4:
        results["two_d"] = {clip: run_two_d(model_dir, clip) for clip in (0.0, CLIP)}
    results["bits"] = {case: run_bits(*case) for case in BITS_CASES}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
