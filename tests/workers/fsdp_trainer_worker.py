"""One rank of ForgeTrainer under accelerate's FSDP2 (started by tests/integrations/test_fsdp_trainer.py
through torch.distributed.run or accelerate launch; gloo on CPU): the cases named, in one launch.

accelerate 1.15 gives DistributedType.FSDP only to accelerator processes: on CPUs it makes the
run MULTI_CPU (DDP) even with an FSDP plugin (accelerate/state.py, AcceleratorState's list of
multi-device types). ``CpuFsdp2Accelerator`` sets the state to what accelerate sets on GPUs -
distributed_type FSDP (AcceleratorState's and PartialState's, as accelerate does at the end of
AcceleratorState.__init__) and the plugin - and nothing else; from there the Trainer and accelerate
take their real FSDP2 path: fully_shard through fsdp2_prepare_model (torch's FSDP2 runs on CPU
with gloo), the optimizer's parameters swapped, activation checkpointing by fsdp2_apply_ac,
and save_fsdp_model / load_fsdp_model for the weights. This is test-only.

A case is (fsdp_config extras, TrainingArguments extras, optim_args extras, resume): each
trains STEPS steps, saving at SAVE_AT; with resume, a second ForgeTrainer resumes from that
checkpoint and runs to STEPS. Rank 0 writes the gathered weights and optimizer state of each.

FSDP2 comes from TrainingArguments (fsdp, fsdp_config), or, when the launch says
ACCELERATE_USE_FSDP=true, from accelerate's FSDP_* variables as `accelerate launch` sets them
from an FSDP config (the launch's own, a case's settings written over them).

On a GPU (device "cuda": tests/integrations/test_fsdp_trainer.py's gpu tests, one process) accelerate sets
FSDP itself: nothing is forced, and the fused kernels run compiled (backend "auto").
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers.trainer
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
from transformers import TrainingArguments

import forge_hf
from forge_hf.optim.fsdp import load_sharded_optimizer
from forge_hf.optim.optimizer import fused_layers
from tests.helpers import tiny_llama as small_llama

VOCAB, SEQ = 64, 8
STEPS, SAVE_AT = 4, 2
CASES = {
    # the default checkpoint of TrainingArguments' fsdp_config: whole states, one file
    "full": (dict(state_dict_type="FULL_STATE_DICT"), {}, "", True),
    # accelerate's FSDP2 default: each rank's rows through DCP, 8-bit states included; its
    # optimizer checkpoint is also loaded again, here or in another world size (RESHARD). The
    # embedding on the ordinary path in one process too: several processes keep it there, with
    # 16-bit states, where one process's compact embedding would keep 8-bit codes
    "sharded": (dict(state_dict_type="SHARDED_STATE_DICT"), {}, ",state_precision=int8,fuse_embedding=false", True),
    # accelerate's activation checkpointing of the decoder layers, activations offloaded
    "checkpointed": (dict(activation_checkpointing=True), {}, "", False),
    # the Trainer's own activation (gradient) checkpointing: transformers' checkpoint of each decoder layer
    "trainer_checkpointing": ({}, dict(activation_checkpointing=True), "", False),
    # mixed precision: FSDP2 all-gathers bf16 weights, the fused layers step the fp32 shards
    "bf16": ({}, dict(bf16=True), "", False),
    # exact accumulation (accelerate's no_sync for FSDP2's gradients) and clipping, active at CLIP
    "accumulate_clip": ({}, dict(gradient_accumulation_steps=2, max_grad_norm=0.05), "", False),
}
RESHARD = "sharded"
OFFLOAD_ENV = "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"  # the plugin's switch for offload_wrapper
CASE_KEYS = ("state_dict_type", "activation_checkpointing")  # what cases set, FSDP_<KEY> for accelerate


# Whether FSDP comes from accelerate's variables (`accelerate launch` with an FSDP config): read
# at start, as Accelerator sets ACCELERATE_USE_FSDP itself once given a plugin
FROM_ACCELERATE_CONFIG = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


class CpuFsdp2Accelerator(Accelerator):
    """accelerate's state as on GPUs under FSDP (see the module docstring). Test-only."""

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        if fsdp_plugin is None and FROM_ACCELERATE_CONFIG:
            fsdp_plugin = FullyShardedDataParallelPlugin()  # from FSDP_*, as Accelerator.__init__ makes it
        super().__init__(*args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:  # the end of AcceleratorState.__init__'s FSDP branch, as on GPUs
            self.state.distributed_type = DistributedType.FSDP
            self.state.fsdp_plugin = fsdp_plugin
            if self.state.mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self.state.mixed_precision)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def tiny_llama():
    return small_llama(VOCAB)


def dataset(world_batch, accumulation=1):
    ids = torch.randint(0, VOCAB, (STEPS * accumulation * world_batch, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out_dir, per_device, optim_extra="", fsdp_extra=None, save=False, device="cpu", **extra):
    """The same run as one process (fsdp_extra None) or under FSDP2."""
    fsdp = {}
    if fsdp_extra is not None and FROM_ACCELERATE_CONFIG:
        for key in CASE_KEYS:
            os.environ.pop(f"FSDP_{key.upper()}", None)
        os.environ.update({f"FSDP_{key.upper()}": str(value) for key, value in fsdp_extra.items()})
        fsdp = dict(ddp_backend="gloo" if device == "cpu" else "nccl")
    elif fsdp_extra is not None:
        fsdp = dict(fsdp=True, ddp_backend="gloo" if device == "cpu" else "nccl",
                    fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], **fsdp_extra})
    backend = "reference" if device == "cpu" else "auto"
    extra = {"max_grad_norm": 0, **extra}
    return TrainingArguments(output_dir=str(out_dir), optim="forge_adamw", use_cpu=device == "cpu",
                             report_to="none", optim_args=f"backend={backend},min_params=0{optim_extra}",
                             per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=1e-3,
                             weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=1,
                             logging_steps=1, save_strategy="steps" if save else "no", save_steps=SAVE_AT,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True, **fsdp, **extra)


def whole(trainer) -> dict:
    """The model's weights and the optimizer's states, whole (collectives: every rank calls)."""
    weights = {k: v.full_tensor().detach().clone() for k, v in trainer.model.state_dict().items()}
    return dict(weights=weights, optimizer=trainer.forge_optimizer.state_dict())


def run_case(name, out_dir, per_device, world, device, reshard_from):
    fsdp_extra, extra, optim_extra, resume = CASES[name]
    os.environ[OFFLOAD_ENV] = str(name == "checkpointed").lower()
    args = training_args(os.path.join(out_dir, name), per_device, optim_extra, fsdp_extra, save=resume,
                         device=device, **extra)
    accumulation = extra.get("gradient_accumulation_steps", 1)
    trainer = forge_hf.ForgeTrainer(model=tiny_llama(), args=args,
                                    train_dataset=dataset(world * per_device, accumulation))
    trainer.train()
    fused = fused_layers(trainer.model)
    result = dict(
        whole(trainer),
        fsdp2=trainer.accelerator.is_fsdp2,
        fsdp_from="TrainingArguments" if trainer.args.fsdp else "accelerate",
        modes=sorted({m.forge_dp.mode for m in fused.values()}),
        no_fused_grad=all(m.weight.grad is None for m in fused.values()),
        # the optimizer the Trainer steps holds the sharded parameters, its states theirs
        bound=all(p in trainer.forge_optimizer.state and isinstance(p, DTensor)
                  for g in trainer.forge_optimizer.param_groups for p in g["params"]),
        grad_norms=[log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log],
        trainer_checkpointing=bool(getattr(trainer.model, "is_activation_checkpointing", False)),
        wrappers=sorted({type(m).__name__ for m in trainer.model.modules() if "Wrapper" in type(m).__name__}),
        state_bytes=sum(m.forge_state.nbytes() for m in fused.values()),
        files=sorted(os.listdir(os.path.join(args.output_dir, f"checkpoint-{SAVE_AT}"))) if resume else [],
    )
    if resume:
        args = training_args(os.path.join(out_dir, name + "-resumed"), per_device, optim_extra, fsdp_extra,
                             save=True, device=device, **extra)
        resumed = forge_hf.ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(world * per_device))
        checkpoint = os.path.join(out_dir, name, f"checkpoint-{SAVE_AT}")
        resumed.train(resume_from_checkpoint=checkpoint)
        result["resumed"] = dict(whole(resumed), global_step=resumed.state.global_step)
        if name == RESHARD:  # its optimizer checkpoint, or another world size's, loaded again
            load_sharded_optimizer(resumed.forge_optimizer,
                                   reshard_from or os.path.join(checkpoint, resumed.FORGE_SHARDED_OPTIMIZER))
            result["reloaded"] = resumed.forge_optimizer.state_dict()["state"]
    return result


def graph_refused(out_dir, device) -> str | None:
    """cuda_graph=true under FSDP2: ForgeTrainer must refuse (a graphed step would broadcast and
    average shards)."""
    os.environ[OFFLOAD_ENV] = "false"  # the last case's may be on, which needs activation checkpointing
    args = training_args(os.path.join(out_dir, "graph"), 1, ",cuda_graph=true", {}, device=device)
    try:
        forge_hf.ForgeTrainer(model=tiny_llama(), args=args, train_dataset=dataset(1))
    except ValueError as error:
        return str(error)
    return None


def main(out_dir, per_device, names, device, reshard_from):
    if device == "cpu":
        transformers.trainer.Accelerator = CpuFsdp2Accelerator  # the Trainer creates its Accelerator by this name
    world = int(os.environ["WORLD_SIZE"])
    results = {name: run_case(name, out_dir, per_device, world, device, reshard_from) for name in names}
    results["graph_refused"] = graph_refused(out_dir, device)
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "fsdp_trainer.pt"))


if __name__ == "__main__":
    # out_dir, local batch, case names, device (cpu | cuda), and optionally the forge_optimizer
    # directory of another launch's RESHARD checkpoint to load
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)
