"""One rank of ForgeTrainer under tensor parallelism (started by tests/integrations/test_tp_trainer.py
through torch.distributed.run; gloo on CPU): the tiny Llama of ``model_dir`` loaded with
tp_plan="auto", so the Trainer gives accelerate ParallelismConfig(tp_size=world); every case in one
launch; rank 0 writes the gathered weights and logged gradient norms of each.

accelerate 1.16 accepts a ParallelismConfig only for accelerator devices (MULTI_GPU, ...) or
FSDP2: on CPUs its Accelerator.__init__ refuses MULTI_CPU (ParallelismConfig._validate_accelerator)
although nothing else in its TP path needs a GPU. ``validate_as_on_gpus`` runs that check as it
runs on GPUs; the rest is the real path. This is test-only.
"""

import os
import sys

import torch
import torch.distributed as dist
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, TrainingArguments

import forge_hf

VOCAB, SEQ, STEPS, PER_DEVICE = 512, 16, 3, 2
CASES = {"plain": {}, "accumulate_clip": dict(gradient_accumulation_steps=2, max_grad_norm=1.0)}

_validate = ParallelismConfig._validate_accelerator


def validate_as_on_gpus(self, accelerator):
    state = accelerator.state
    kind = state.distributed_type
    if kind == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU
    try:
        return _validate(self, accelerator)
    finally:
        state.distributed_type = kind


def dataset(accumulation=1):
    ids = torch.randint(0, VOCAB, (STEPS * accumulation * PER_DEVICE, SEQ), generator=torch.Generator().manual_seed(5))
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out_dir, tp, **extra):
    extra = {"max_grad_norm": 0, **extra, **({"ddp_backend": "gloo"} if tp else {})}
    return TrainingArguments(output_dir=str(out_dir), optim="forge_adamw", use_cpu=True, report_to="none",
                             optim_args="backend=reference,min_params=0", per_device_train_batch_size=PER_DEVICE,
                             max_steps=STEPS, learning_rate=1e-3, weight_decay=0.01, logging_steps=1,
                             save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True, **extra)


def train(model_dir, name, out_dir, tp):
    """One case's run: the weights after STEPS steps (whole) and the logged gradient norms."""
    extra = CASES[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **({"tp_plan": "auto"} if tp else {}))
    trainer = forge_hf.ForgeTrainer(model=model, args=training_args(os.path.join(out_dir, name), tp, **extra),
                                    train_dataset=dataset(extra.get("gradient_accumulation_steps", 1)))
    trainer.train()
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in trainer.model.state_dict().items()}
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    return dict(weights=weights, norms=norms, fused=len(trainer.forge_report.fused),
                data_parallel=any(m.forge_dp is not None for m in trainer.model.modules() if hasattr(m, "forge_dp")))


def main(out_dir, model_dir):
    ParallelismConfig._validate_accelerator = validate_as_on_gpus
    results = {name: train(model_dir, name, out_dir, tp=True) for name in CASES}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "tp_trainer.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
