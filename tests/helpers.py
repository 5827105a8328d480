"""Shared test tools: the device, exactly summable inputs, tolerances, small comparisons, the
worker scripts' folder, the benchmark tools' modules and compiling runs."""

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# the multi-process tests' rank scripts, started by path with ROOT on PYTHONPATH (they import
# tests.helpers and this checkout's forge_hf)
WORKERS = ROOT / "tests" / "workers"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Tests on CPU tensors through backend="triton": Triton's interpreter, set up by conftest.py only
# where no GPU is
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="runs Triton's interpreter on CPU tensors, set up only without a GPU")


# fp32 weights and states against torch.optim fed the same gradient: relative to the
# largest weight, so near-zero entries are judged on the tensor's scale.
RTOL_FP32 = 1e-5


def exact_inputs(shape_x, n_out, dtype=torch.float32, device="cpu", generator=None):
    """x and dy with few mantissa bits: every product and every partial sum over <= 2**12
    tokens is exact in fp32, so the gradient does not depend on summation order."""
    x = torch.randint(-4, 5, shape_x, generator=generator).float() / 4
    dy = torch.randint(-4, 5, (*shape_x[:-1], n_out), generator=generator).float() / 256
    return x.to(device=device, dtype=dtype), dy.to(device=device, dtype=dtype)


def exact_gradient(x, dy):
    """dY^T X in float64 (exact for exact_inputs), as the weight's (out, in) gradient."""
    k, n = x.shape[-1], dy.shape[-1]
    return dy.reshape(-1, n).double().t() @ x.reshape(-1, k).double()


def assert_close_rel(actual, expected, rtol=RTOL_FP32, what=""):
    expected = expected.to(actual.dtype)
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error {err:.3e} of the largest entry exceeds {rtol:.0e}"


def _bf16_ordinal(t):
    # sign-magnitude bits -> a line where neighbouring bf16 values differ by 1 (+0 == -0)
    i = t.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def bf16_ulps_apart(a, b):
    """Distance in bf16 representable steps, across zero too."""
    return (_bf16_ordinal(a) - _bf16_ordinal(b)).abs()


# ------------------------------------------------- data parallel without processes


class FakeTwoRanks:
    """torch.distributed's all-gather as two identical ranks would run it, recording the
    calls: the collectives' structure, checked without processes."""

    def __init__(self, monkeypatch):
        from forge_hf.optim import distributed

        self.calls = []
        monkeypatch.setattr(distributed.dist, "all_gather_into_tensor", self.all_gather_into_tensor)

    def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
        self.calls.append((tuple(inp.shape), group))
        out.copy_(torch.cat([inp, inp]))

        class Done:
            def wait(self):
                pass

        return Done() if async_op else None


def two_rank_gather(counts=None):
    """A TokenGather of rank 0 of two, without a process group (with FakeTwoRanks)."""
    from forge_hf.optim.distributed import TokenCounts, TokenGather

    if counts is None:
        counts = TokenCounts.__new__(TokenCounts)
        counts.group, counts.world, counts.pending, counts.is_frozen = "tokens", 2, [], False
    gather = TokenGather.__new__(TokenGather)
    gather.group, gather.world, gather.rank, gather.bytes_sent, gather.counted = "tokens", 2, 0, 0, None
    gather.counts = counts
    return gather


def tiny_llama(vocab: int, hidden: int = 32, intermediate: int = 64, seed: int = 0):
    """A two-layer Llama built from its config (nothing downloaded), its weights from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def adamw_bf16_layer(precision="bf16", n=70, k=130, device="cpu"):
    """A bf16 (n, k) weight with its allocated AdamW state of ``precision``: (weight,
    ForgeState, rule, group), for launching the fused kernels directly."""
    from forge_hf.core.rules import get_rule, make_group
    from forge_hf.core.state import ForgeState

    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-2, weight_decay=0.1))
    w = torch.linspace(-0.5, 0.5, n * k, device=device).view(n, k).to(torch.bfloat16)
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, group)
    return w, state, rule, group


@contextlib.contextmanager
def benchmark_module(name: str):
    """A module of benchmarks/, imported with that folder on sys.path while the context lasts
    (the tools import each other by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def run_compiling_tool(script: str, *arguments) -> subprocess.CompletedProcess:
    """A tool of benchmarks/ run in a child process that compiles its kernels as on a GPU:
    without the interpreter conftest sets, this checkout's forge_hf first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, script, *arguments], cwd=BENCHMARKS, env=env, capture_output=True,
                          text=True, timeout=600)


def write_checkpoint(path: Path) -> Path:
    """A small checkpoint-N holding the files a Trainer checkpoint does, each whole
    (forge_hf.integrations.checkpoints checks them without loading them)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text('{"global_step": 1}')
    save_file({"weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, path / "optimizer.pt")
    torch.save({"last_epoch": 1}, path / "scheduler.pt")
    torch.save({"cpu": torch.random.get_rng_state()}, path / "rng_state.pth")
    return path


def stepped_layer(options: dict, steps: int = 3, conv1d: bool = False, shape=(70, 130), tokens: int = 45):
    """A fused Linear (or Conv1D) of ``shape`` (out, in) made with forge ``options`` and stepped
    ``steps`` times on exact_inputs, the same ones for the same arguments."""
    from transformers.pytorch_utils import Conv1D

    from forge_hf import ForgeLinear
    from forge_hf.nn.conv1d import ForgeConv1D

    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    n_out, n_in = shape
    if conv1d:
        layer = ForgeConv1D.from_conv1d(Conv1D(n_out, n_in).to(DEVICE), **options)
    else:
        layer = ForgeLinear.from_linear(torch.nn.Linear(n_in, n_out, bias=False, device=DEVICE), **options)
    for _ in range(steps):
        x, dy = exact_inputs((tokens, n_in), n_out, generator=gen, device=DEVICE)
        layer(x).backward(dy)
    return layer
