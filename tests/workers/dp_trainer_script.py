"""ForgeTrainer under torchrun (tests/optim/test_distributed.py): trains a tiny Llama and saves
this rank's weights. Run with WORLD=1 it is the single-process reference. A fourth argument:
gradient_accumulation_steps."""

import os
import sys

import torch
from transformers import TrainingArguments

import forge_hf
from tests.workers.dp_worker import SEQ, VOCAB, tiny_llama


def main(out_dir, per_device, mode, accumulation=1):
    gen = torch.Generator().manual_seed(3)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (8, SEQ), generator=gen)]
    args = TrainingArguments(output_dir=out_dir, optim="forge_adamw", use_cpu=True, report_to="none",
                             optim_args=f"backend=reference,min_params=0,data_parallel={mode}",
                             per_device_train_batch_size=per_device, max_steps=3, learning_rate=1e-3,
                             weight_decay=0.01, max_grad_norm=0, logging_steps=1, save_strategy="no", seed=0,
                             dataloader_num_workers=0, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
                             gradient_accumulation_steps=accumulation)
    trainer = forge_hf.ForgeTrainer(model=tiny_llama(), args=args, train_dataset=rows)
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(out_dir, f"trainer_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:]))
