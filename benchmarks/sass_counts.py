"""The Triton fused kernel's machine code for Hopper, counted without a GPU: each variant is
compiled for sm_90 as a launch would compile it (the layer's default tile config), and its
SASS instructions are counted by opcode (Triton's nvdisasm). A kernel whose time is set by its
arithmetic (the rule pass over a given gradient, the 4-bit codecs) takes about its
instructions an element times the elements over the GPU's issue rate, so the count guides
work on the kernel between GPU runs; the GPU's time decides (kernel_microbench.py).

    python benchmarks/sass_counts.py --precisions bf16,log4_factored --tokens 0      # rule pass
    python benchmarks/sass_counts.py --rules adamw,lion --precisions int8 --tokens 512 --opcodes 20
    python benchmarks/sass_counts.py --precisions log4_factored --ablate no_state_stores  # kernel_ablations.py

--tokens 0 compiles the rule pass over a given fp32 gradient (the two-pass path's second pass
and ForgeOptimizer's non-fused tensors); otherwise the fused kernel's GEMM and epilogue, whose
token loop runs once a chunk (its instructions are not all run once an element).
"""

import argparse
import collections
import os
import pathlib
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from forge_hf.core.rules import get_rule, make_group  # noqa: E402
from forge_hf.core.state import ForgeState  # noqa: E402
from forge_hf.kernels.runtime.launch_args import pack_args  # noqa: E402
from forge_hf.kernels.triton.fused_update import (  # noqa: E402
    compile_options,
    default_config,
    fused_launch_arguments,
    fused_update_kernel,
)

import kernel_ablations  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int16: "i16", torch.int32: "i32",
               torch.int8: "i8", torch.uint8: "u8"}


def signature(names: list, positional: list) -> dict:
    """Triton's signature of a launch's non-constexpr arguments (pointers, TMA descriptors,
    int32), to compile a kernel ahead of its launch for another GPU than this machine's."""
    from triton.runtime.jit import mangle_type

    return {n: "*" + _TYPE_NAMES[v.dtype] if torch.is_tensor(v) else mangle_type(v) if hasattr(v, "block_shape")
            else "i32" for n, v in zip(names, positional)}


def compile_fused(rule_name: str, precision: str, shape: tuple[int, int], tokens: int, stochastic: bool = True,
                  extra: dict | None = None, weight_dtype=torch.bfloat16, grad_dtype=torch.float32):
    """The Triton kernel for one layer of ``shape`` (out, in) with ``precision`` states,
    compiled for sm_90 as its launch would be; ``tokens`` 0: the rule pass over a given
    gradient of ``grad_dtype`` (fp32: the two-pass path's scratch)."""
    n, k = shape
    rule = get_rule(rule_name)
    group = make_group(rule, extra or {})
    weight = torch.zeros(n, k, dtype=weight_dtype)
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(weight, group)
    if tokens:
        x, dy = torch.zeros(tokens, k, dtype=torch.bfloat16), torch.zeros(tokens, n, dtype=torch.bfloat16)
    else:  # x is the (N, K) gradient itself
        x = dy = torch.zeros(n, k, dtype=grad_dtype)
    args = pack_args(rule.prepare(group, state.host), 1, 0, "cpu")
    config = default_config(n, k, tokens)  # what a GPU launch uses
    _, positional, constexprs = fused_launch_arguments(
        x, dy, weight, state.kernel_slots(), args, torch.zeros(2), rule_name, stochastic, dot_fp32=False,
        grad_given=not tokens)
    names = fused_update_kernel.arg_names
    sig = signature(names, positional)
    sig.update({name: "constexpr" for name in constexprs})
    source = triton.compiler.ASTSource(fn=fused_update_kernel, signature=sig,
                                       constexprs={(names.index(name),): v for name, v in constexprs.items()})
    return triton.compile(source, target=HOPPER, options=compile_options(config)), config


def opcodes(cubin: bytes) -> collections.Counter:
    """SASS instructions of a cubin by opcode (predicates and modifiers dropped)."""
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    for line in listing.splitlines():
        body = line.split("*/", 1)[1].strip() if line.strip().startswith("/*") and "*/" in line else ""
        words = body.rstrip(" ;").split()
        if words:
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            counts[op.split(".")[0]] += 1
    return counts


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", default="adamw")
    parser.add_argument("--precisions", default="bf16,log4_factored")
    parser.add_argument("--shape", default="4096x4096", help="the layer's OUTxIN")
    parser.add_argument("--tokens", type=int, default=0, help="0: the rule pass over a given gradient")
    parser.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic")
    parser.add_argument("--opcodes", type=int, default=12, help="the most frequent opcodes shown")
    parser.add_argument("--ablate", default="none", choices=["none", *sorted(kernel_ablations.TRITON)],
                        help="count the kernel without one of its stages (kernel_ablations.py)")
    args = parser.parse_args(argv)
    if args.ablate != "none":
        kernel_ablations.apply_triton(args.ablate)
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = []
    print("| rule | precision | tokens | instructions | an element | spilled (LDL+STL) | most frequent |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rule_name in args.rules.split(","):
        for precision in args.precisions.split(","):
            compiled, config = compile_fused(rule_name, precision, shape, args.tokens, args.rounding == "stochastic")
            counts = opcodes(compiled.asm["cubin"])
            block_n, block_k, _ = config["blocks"]
            total = sum(counts.values())
            per_element = total / (block_n * block_k / (32 * config["num_warps"]))  # a program's tile per thread
            row = dict(rule=rule_name, precision=precision, tokens=args.tokens, instructions=total,
                       per_element=per_element, spilled=counts["LDL"] + counts["STL"], opcodes=dict(counts))
            rows.append(row)
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(args.opcodes))
            cells = [rule_name, precision, args.tokens, total, f"{per_element:.1f}", row["spilled"], top]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    return rows


if __name__ == "__main__":
    main()
