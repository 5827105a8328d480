"""A digest of every fused-kernel variant's machine code for Hopper, compiled without a GPU
(sm90_compile.py): to show that a change to the code around the kernels leaves what runs on
the GPU as it was. Run it on the checkout before the change and on the one after, then compare with the same arguments:

    git worktree add /tmp/before main
    PYTHONPATH=/tmp/before python benchmarks/sass_digests.py --out /tmp/before.json
    python benchmarks/sass_digests.py --against /tmp/before.json

A variant is a kernel (the Triton one, the persistent and the wide Gluon ones), a rule with
the hyperparameters that change its code, a weight dtype, a state precision, a rounding and,
for the Triton kernel, what it is given: tokens (a layer whose shape is not a multiple of
the tile, or one of whole tiles) or a gradient (the weight's dtype, or the two-pass path's
fp32 scratch). Variants the package refuses, or a kernel does not take, are listed with the
reason. The exit status is 1 where --against finds a variant whose code differs.
"""

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os

# first: it takes TRITON_INTERPRET away
from sm90_compile import KERNELS, compile_fused, compile_gluon, disassemble, instructions, unsupported

# isort: split
import torch

import forge_hf
from forge_hf.core.config import STATE_PRECISIONS

# a rule, and the hyperparameters that give it other slots or other code
RULE_KEYS = {"adagrad": {}, "adamw": {}, "lion": {}, "nadam": {}, "radam": {}, "rmsprop": {},
             "rmsprop-centered": dict(momentum=0.9, centered=True), "sgd": {}, "sgd-momentum": dict(momentum=0.9)}
WEIGHTS = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRECISIONS = tuple(p for p in STATE_PRECISIONS if p != "auto")  # auto picks one of them per weight
ROUNDINGS = ("stochastic", "nearest")
# what the Triton kernel is given: ((out, in), tokens, gradient dtype; None: the weight's)
TRITON_INPUTS = {"tokens": ((200, 300), 77, None), "whole_tiles": ((256, 512), 128, None),
                 "grad": ((200, 300), 0, None), "fp32_scratch": ((200, 300), 0, torch.float32)}


def variants(kernels, rule_keys, weights, precisions, roundings, inputs) -> list[tuple]:
    """(kernel, rule key, weight, precision, rounding, input) of each variant asked for;
    ``inputs`` are the Triton kernel's (the Gluon kernels are given tokens)."""
    found = []
    for kernel in kernels:
        kernel_inputs = inputs if kernel == "triton" else ["-"]
        for key in rule_keys:
            for weight in weights if kernel == "triton" else ["bf16"]:
                for precision in precisions:
                    found += [(kernel, key, weight, precision, rounding, given)
                              for rounding in roundings for given in kernel_inputs]
    return found


def digest(variant: tuple) -> tuple[str, str]:
    """(name, the SASS's sha256 and instruction count, or why there is none)."""
    kernel, key, weight, precision, rounding, given = variant
    name = "/".join(variant)
    rule_name, extra = key.split("-")[0], RULE_KEYS[key]
    reason = unsupported(kernel, rule_name, precision, extra, WEIGHTS[weight])
    if reason is not None:
        return name, f"not taken: {reason}"
    stochastic = rounding == "stochastic"
    try:
        if kernel == "triton":
            shape, tokens, grad_dtype = TRITON_INPUTS[given]
            compiled, _ = compile_fused(rule_name, precision, shape, tokens, stochastic, extra, WEIGHTS[weight],
                                        grad_dtype or WEIGHTS[weight])
        else:
            compiled = compile_gluon(kernel, rule_name, precision, stochastic, extra)
        sass = disassemble(compiled.asm["cubin"])
    except Exception as e:  # a variant that does not compile is a finding, listed with the rest
        return name, f"error: {type(e).__name__}: {str(e)[-300:]}"
    return name, f"{hashlib.sha256(sass.encode()).hexdigest()[:20]} {len(instructions(sass))}"


def compare(now: dict, then: dict) -> list[str]:
    """Lines naming each variant whose digest differs, or that one side lacks."""
    lines = []
    for name in sorted(set(now) | set(then)):
        if now.get(name) != then.get(name):
            lines.append(f"{name}: {then.get(name, 'absent')} -> {now.get(name, 'absent')}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--rules", default=",".join(RULE_KEYS), help=f"of {list(RULE_KEYS)}")
    parser.add_argument("--weights", default=",".join(WEIGHTS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--roundings", default=",".join(ROUNDINGS))
    parser.add_argument("--inputs", default=",".join(TRITON_INPUTS), help="the Triton kernel's")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiles at once")
    parser.add_argument("--out", help="write the digests here (JSON)")
    parser.add_argument("--against", help="digests written by an earlier --out: list what differs")
    args = parser.parse_args(argv)
    asked = dict(kernels=(args.kernels, KERNELS), rules=(args.rules, RULE_KEYS), weights=(args.weights, WEIGHTS),
                 precisions=(args.precisions, PRECISIONS), roundings=(args.roundings, ROUNDINGS),
                 inputs=(args.inputs, TRITON_INPUTS))
    for option, (values, known) in asked.items():
        unknown = [v for v in values.split(",") if v not in known]
        if unknown:
            parser.error(f"--{option} {','.join(unknown)}: choose among {','.join(known)}")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    if args.against and not os.path.isfile(args.against):
        parser.error(f"--against {args.against}: no such file; write one with --out")
    todo = variants(*(values.split(",") for values, _ in asked.values()))
    print(f"{len(todo)} variants of forge_hf at {os.path.dirname(forge_hf.__file__)}, {args.jobs} at once", flush=True)
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        digests = dict(pool.map(digest, todo))
    compiled = sum(not v.startswith(("not taken", "error")) for v in digests.values())
    errors = [f"{name}: {v}" for name, v in digests.items() if v.startswith("error")]
    print(f"compiled {compiled}, not taken {len(digests) - compiled - len(errors)}, errors {len(errors)}")
    print("\n".join(errors))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
    if not args.against:
        return 0
    with open(args.against) as f:
        differ = compare(digests, json.load(f))
    print(f"against {args.against}: {len(differ)} differ")
    print("\n".join(differ))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
