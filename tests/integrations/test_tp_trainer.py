"""ForgeTrainer under tensor parallelism: 2 gloo ranks holding the tiny Llama under tp_plan="auto"
(tests/workers/tp_trainer_worker.py, launched by torch.distributed.run; accelerate's ParallelismConfig
from the model) against one process's ForgeTrainer on the same batches."""

import os
import subprocess
import sys
import types

import pytest
import torch

from forge_hf import ForgeTrainer
from tests.helpers import ROOT, WORKERS
from tests.optim.test_tensor_parallel import RTOL_TP, assert_tp_close
from tests.workers import tp_trainer_worker as worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.optim.test_tensor_parallel import model_dir as make

    return make.__wrapped__(tmp_path_factory)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("tp_trainer")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKERS / "tp_trainer_worker.py"), str(out), model_dir],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return torch.load(out / "tp_trainer.pt", weights_only=False), out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.CASES))
def test_trainer_under_tp_follows_one_process(name, launched, model_dir, tmp_path):
    """Every linear fused, no forge data parallelism (the ranks are one TP group with the same
    batches), and the weights and logged norms of one process's ForgeTrainer within TP's round-off,
    accumulated and clipped too."""
    results, _ = launched
    got = results[name]
    assert got["fused"] == 15 and not got["data_parallel"]
    torch.set_num_threads(1)
    ref = worker.train(model_dir, name, tmp_path, tp=False)
    assert_tp_close(got["weights"], ref["weights"], name)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=RTOL_TP, atol=0)


def test_tp_with_data_replicas_is_refused():
    """TP over part of the world with the other ranks as DDP replicas: refused, naming the sizes and the fix."""
    trainer = types.SimpleNamespace(get_tp_size=lambda: 2, args=types.SimpleNamespace(world_size=4))
    with pytest.raises(ValueError, match=r"^tp_size=2 with 2 data-parallel replicas \(world size 4\) is not supported "
                                         r".*ParallelismConfig\(tp_size=2, dp_shard_size=2\)"):
        ForgeTrainer.forge_tensor_parallel_only(trainer)
