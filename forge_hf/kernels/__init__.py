"""The fused weight-gradient + optimizer step of a linear layer, and the code that chooses and
launches it (docs/kernels.md). What the layers above use is named here; nothing above
imports a module inside. Imports nothing of Hugging Face.

    select.py     which kernel runs a layer's step, and which path: the one place either is chosen
    dispatch.py   the backend, a layer's launches bound once, the fused-or-two-pass timing
    two_pass.py   the two-pass path's weight gradient: cuBLAS into one scratch buffer a device
    rounded_sum.py  a bf16 buffer plus fp32 sums, rounded stochastically (held gradients)
    reference.py  the step in PyTorch, tile by tile: the CPU backend and the tests' oracle
    launch/       host-side launching, one file per kernel
    triton/       the @triton.jit kernels and the jit functions they share with gluon/
    gluon/        the Hopper (sm_90) Gluon kernels: persistent_update.py, wide_update.py
    runtime/      what every launch stands on: per-step argument rows, relaunching compiled code
"""

from .dispatch import bind_fused_update, launch_fused_update, launch_rule_step, resolve_backend
from .launch.fused_update_launch import BoundLaunch
from .reference import RULE_UPDATES as TORCH_RULE_UPDATES
from .reference import reference_fused_update, reference_rule_rows
from .rounded_sum import add_rounded
from .runtime.arg_words import ROW_STRIDE
from .runtime.launch_args import ARGS_LEN, ArgsTable, next_launch_args, pack_args, release_held_args
from .select import MANY_TOKENS, TWO_PASS_MARGIN, faster_path
from .triton.cross_entropy import row_grad_, row_lse
from .triton.multi_tensor import MultiTensorRulePass, batch_kind
from .two_pass import GradientScratch, addmm_fp32, grow_reserved_scratch, matmul_fp32, weight_gradient

__all__ = ["ARGS_LEN", "ArgsTable", "ROW_STRIDE",
           "BoundLaunch", "GradientScratch", "add_rounded", "MANY_TOKENS", "TORCH_RULE_UPDATES", "TWO_PASS_MARGIN",
           "addmm_fp32", "bind_fused_update", "faster_path", "grow_reserved_scratch", "launch_fused_update",
           "launch_rule_step", "matmul_fp32", "next_launch_args", "pack_args", "reference_fused_update",
           "reference_rule_rows", "release_held_args", "resolve_backend", "weight_gradient",
           "MultiTensorRulePass", "batch_kind", "row_grad_", "row_lse"]
