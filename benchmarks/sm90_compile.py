"""The fused kernels compiled for Hopper (sm_90) on a machine without a GPU, each as its launch
would compile it for the same tensors: the Triton kernel (triton/fused_update.py) and the two
Gluon kernels (persistent, wide). Triton's wheel carries ptxas and nvdisasm, so the whole
pipeline runs down to the SASS. Import this module before anything else imports Triton's
kernels: it takes TRITON_INTERPRET away, since an interpreted kernel has no machine code.
Used by sass_counts.py, sass_digests.py and tests/kernels/test_kernel_compiles.py.
"""

import os
import pathlib
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from forge_hf.core.precision_checks import check_group  # noqa: E402
from forge_hf.core.rules import get_rule, make_group  # noqa: E402
from forge_hf.core.state import ForgeState  # noqa: E402
from forge_hf.kernels.runtime.launch_args import pack_args  # noqa: E402
from forge_hf.kernels.triton.fused_update import (  # noqa: E402
    RULE_UPDATES,
    compile_options,
    default_config,
    fused_launch_arguments,
    fused_update_kernel,
)

HOPPER = GPUTarget("cuda", 90, 32)
KERNELS = ("triton", "persistent", "wide")
GLUON_SHAPES = {"persistent": (128, 192), "wide": (256, 384)}  # (out, in): multiples of each one's tile
_TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int16: "i16", torch.int32: "i32",
               torch.int8: "i8", torch.uint8: "u8"}


def signature(names: list, positional: list) -> dict:
    """Triton's signature of a launch's non-constexpr arguments (pointers, TMA descriptors,
    int32), to compile a kernel ahead of its launch for another GPU than this machine's."""
    from triton.runtime.jit import mangle_type

    return {n: "*" + _TYPE_NAMES[v.dtype] if torch.is_tensor(v) else mangle_type(v) if hasattr(v, "block_shape")
            else "i32" for n, v in zip(names, positional)}


def _layer(rule_name: str, precision: str, shape: tuple[int, int], extra: dict | None, weight_dtype):
    """A zero weight of ``shape`` with its allocated state, and the rule's packed arguments."""
    rule = get_rule(rule_name)
    group = make_group(rule, extra or {})
    weight = torch.zeros(*shape, dtype=weight_dtype)
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(weight, group)
    return rule, weight, state, pack_args(rule.prepare(group, state.host), 1, 0, "cpu")


def compile_fused(rule_name: str, precision: str, shape: tuple[int, int], tokens: int, stochastic: bool = True,
                  extra: dict | None = None, weight_dtype=torch.bfloat16, grad_dtype=torch.float32):
    """(compiled kernel, tile config): the Triton kernel for one layer of ``shape`` (out, in)
    with ``precision`` states; ``tokens`` 0: the rule pass over a given gradient of
    ``grad_dtype`` (fp32: the two-pass path's scratch)."""
    n, k = shape
    _, weight, state, args = _layer(rule_name, precision, shape, extra, weight_dtype)
    if tokens:
        x, dy = torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(tokens, n, dtype=torch.bfloat16)
    else:  # x is the (N, K) gradient itself
        x = dy = torch.zeros(n, k, dtype=grad_dtype)
    config = default_config(n, k, tokens)  # what a GPU launch uses
    _, positional, constexprs = fused_launch_arguments(
        x, dy, weight, state.kernel_slots(), args, torch.zeros(2), rule_name, stochastic, dot_fp32=False,
        grad_given=not tokens)
    source = _source(triton.compiler.ASTSource, fused_update_kernel, positional, constexprs)
    return triton.compile(source, target=HOPPER, options=compile_options(config)), config


def _source(kind, jitted, positional: list, constexprs: dict, **attrs):
    """``kind`` (Triton's or Gluon's AST source) of ``jitted`` for a launch's arguments:
    ``positional`` typed by ``signature``, ``constexprs`` by name."""
    names = jitted.arg_names
    sig = signature(names, positional)
    sig.update({name: "constexpr" for name in constexprs})
    return kind(fn=jitted, signature=sig, constexprs={(names.index(name),): v for name, v in constexprs.items()},
                **attrs)


def _divisibility(positional: list) -> dict:
    """What Triton's launch specialises on: a pointer 16-byte aligned, an int a multiple of 16
    (the Gluon kernels' weights and states always are; their rows and columns are multiples
    of 64), so the compiled code, its vector loads and its registers, are the GPU's."""
    aligned = [i for i, v in enumerate(positional)
               if (torch.is_tensor(v) and v.data_ptr() % 16 == 0) or (type(v) is int and v % 16 == 0)]
    return {(i,): [["tt.divisibility", 16]] for i in aligned}


def unsupported(kernel: str, rule_name: str, precision: str, extra: dict | None = None,
                weight_dtype=torch.bfloat16) -> str | None:
    """Why ``kernel`` ("triton", "persistent" or "wide") takes no layer with these states and
    hyperparameters (None: it takes one): what ForgeState refuses, and each Gluon kernel's
    own limits."""
    rule = get_rule(rule_name)
    try:
        check_group(rule, precision, make_group(rule, extra or {}))
    except ValueError as refusal:
        return str(refusal)
    if kernel == "triton":
        return None
    if weight_dtype != torch.bfloat16:
        return "the Gluon kernels take bf16 weights"
    from forge_hf.core.codecs import storage_kinds
    from forge_hf.kernels.launch.persistent_launch import weight_unsupported
    from forge_hf.kernels.launch.wide_launch import wide_layer_unsupported

    _, weight, state, _ = _layer(rule_name, precision, GLUON_SHAPES[kernel], extra, torch.bfloat16)
    slots = state.kernel_slots()
    check = weight_unsupported if kernel == "persistent" else wide_layer_unsupported
    return check(weight, slots, storage_kinds(slots))


def compile_gluon(kernel: str, rule_name: str, precision: str, stochastic: bool = True, extra: dict | None = None):
    """The Gluon ``kernel`` ("persistent" or "wide") for a bf16 layer with ``precision``
    states and 100 tokens, compiled for sm_90 as its launch compiles it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from forge_hf.kernels.gluon.persistent_update import persistent_update_kernel
    from forge_hf.kernels.gluon.wide_update import wide_update_kernel
    from forge_hf.kernels.launch.gluon_launch import tokens_unsupported
    from forge_hf.kernels.launch.persistent_launch import persistent_launch_arguments
    from forge_hf.kernels.launch.wide_launch import wide_launch_arguments

    jitted, arguments = {
        "persistent": (persistent_update_kernel, persistent_launch_arguments),
        "wide": (wide_update_kernel, wide_launch_arguments),
    }[kernel]
    n, k = shape = GLUON_SHAPES[kernel]
    x, dy = torch.zeros(100, k, dtype=torch.bfloat16), torch.zeros(100, n, dtype=torch.bfloat16)
    reason = unsupported(kernel, rule_name, precision, extra) or tokens_unsupported(x, dy)
    if reason is not None:
        raise ValueError(f"the {kernel} kernel takes no {rule_name} layer with {precision} states: {reason}")
    rule, weight, state, args = _layer(rule_name, precision, shape, extra, torch.bfloat16)
    positional, constexprs, options = arguments(x, dy, weight, state.kernel_slots(), args, torch.zeros(2),
                                                RULE_UPDATES[rule.name], stochastic)
    source = _source(GluonASTSource, jitted, positional, constexprs, attrs=_divisibility(positional))
    return triton.compile(source, target=HOPPER, options=options)


def _triton_tool(name: str, option: str, cubin: bytes) -> str:
    """What one of the CUDA tools in Triton's wheel prints for ``cubin``."""
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), option, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    """A cubin's SASS as nvdisasm lists it (code only)."""
    return _triton_tool("nvdisasm", "-c", cubin)


def instructions(sass: str) -> list[str]:
    """The instructions of a ``disassemble`` listing, each as written after its address."""
    return [line.split("*/", 1)[1].strip() for line in sass.splitlines()
            if line.strip().startswith("/*") and "*/" in line]


def stack_bytes(cubin: bytes) -> int:
    """The stack frame ptxas gave the kernel: registers spilled where it is not 0."""
    return int(re.search(r"STACK:(\d+)", _triton_tool("cuobjdump", "-res-usage", cubin)).group(1))
