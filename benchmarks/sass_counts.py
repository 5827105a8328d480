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

from sm90_compile import compile_fused, disassemble, instructions  # first: it takes TRITON_INTERPRET away

# isort: split
import kernel_ablations


def opcodes(cubin: bytes) -> collections.Counter:
    """SASS instructions of a cubin by opcode (predicates and modifiers dropped)."""
    counts = collections.Counter()
    for body in instructions(disassemble(cubin)):
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
