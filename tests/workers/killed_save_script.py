"""`forge-hf train ARGS...` that kills itself with SIGKILL halfway through writing
checkpoint-<KILL_AT>'s optimizer.pt (KILL_AT from the environment): what a crash or a
preempted job leaves behind, at a point the test chooses."""

import io
import os
import signal
import sys

import torch

from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.train import cli

KILL_AT = int(os.environ["KILL_AT"])
save_optimizer_and_scheduler = ForgeTrainer._save_optimizer_and_scheduler


def save_half_then_die(self, output_dir):
    if self.state.global_step != KILL_AT:
        return save_optimizer_and_scheduler(self, output_dir)
    archive = io.BytesIO()
    torch.save(self.optimizer.state_dict(), archive)
    with open(os.path.join(output_dir, "optimizer.pt"), "wb") as f:
        f.write(archive.getvalue()[:archive.tell() // 2])
    os.kill(os.getpid(), signal.SIGKILL)


ForgeTrainer._save_optimizer_and_scheduler = save_half_then_die
sys.exit(cli.main(["train", *sys.argv[1:]]))
