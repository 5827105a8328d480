"""What the fused layers hold between the backward and the optimizer step under gradient
accumulation or clipping (nn/held_gradient.py), on a real-shaped model, measured without a GPU.

The model is built on the meta device (shapes, no memory) and patched; ``--micro`` forwards and
backwards of ``--tokens`` tokens each run through forge's own holding code, which chooses per
layer (``--accumulation auto``: the stash while its rows take no more than the layer's gradient
in the weight's dtype, a plain Trainer's, then the fp32 buffer where that fits, else a bf16
buffer rounded stochastically). Each layer type's row: how many layers, what they hold, its
bytes over the model, a plain Trainer's gradients of those layers, the bytes held a parameter,
and the most any one layer held against its own Trainer gradient (``held/Trainer``: 1.0 or
less under auto); a stash's input rows that several layers read (q/k/v, gate/up) count once,
under the first of them. Beside the total: an fp32 buffer for every layer (the FORGE paper's
Appendix L) and the weight gradients a plain Trainer keeps.

    python benchmarks/held_bytes.py --models llama-3.1-8b --tokens 512 --micro 4
    python benchmarks/held_bytes.py --models llama-3.1-8b,qwen3-0.6b --tokens 2048 --micro 1   # clipping
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from forge_hf.core.config import ACCUMULATION_MODES
from forge_hf.nn.held_gradient import trainer_bytes

from models import build_model

GIB = 2**30
BUFFER_NAMES = {torch.float32: "fp32 buffer", torch.bfloat16: "bf16 buffer"}


def held_rows(model_name: str, tokens: int, micro: int, accumulation: str = "auto") -> dict:
    """The layer types' rows and the totals for ``micro`` micro-batches of ``tokens`` tokens."""
    import forge_hf
    from forge_hf.optim.optimizer import fused_layers

    model = build_model(model_name, device="meta")
    forge_hf.patch_model(model, optimizer="adamw", state_precision="bf16", backend="reference",
                         accumulation=accumulation)
    forge_hf.ForgeOptimizer(model, lr=1e-5, accumulate=True)
    for _ in range(micro):
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        (model(input_ids=ids, labels=ids).loss / micro).backward()
    types: dict[str, dict] = {}
    seen: set[int] = set()  # storages counted already: an input several layers hold
    weights = grad_bytes = 0
    for name, layer in fused_layers(model).items():
        held = layer.forge_held
        kind = re.sub(r"^.*layers\.\d+\.", "", name)
        row = types.setdefault(kind, dict(layer=kind, count=0, holds=set(), gib=0.0, trainer_gib=0.0, params=0,
                                          worst=0.0))
        bound = trainer_bytes(layer.in_features, layer.out_features, layer.weight.dtype)
        row["count"] += 1
        row["params"] += layer.weight.numel()
        row["trainer_gib"] += bound / GIB
        row["worst"] = max(row["worst"], held.nbytes() / bound)
        weights += layer.weight.numel()
        grad_bytes += bound
        if held.buffer is not None:
            row["holds"].add(BUFFER_NAMES[held.buffer.dtype])
            row["gib"] += held.nbytes() / GIB
            continue
        row["holds"].add("stash")
        for t in (t for pair in held.stash for t in pair):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                row["gib"] += t.untyped_storage().nbytes() / GIB
    rows = [dict(r, holds="/".join(sorted(r["holds"])), bytes_per_param=r["gib"] * GIB / r["params"])
            for r in types.values()]
    return dict(model=model_name, tokens=tokens, micro=micro, accumulation=accumulation, layers=rows,
                held_gib=sum(r["gib"] for r in rows), buffer_gib=weights * 4 / GIB, grad_gib=grad_bytes / GIB)


def markdown(result: dict) -> str:
    lines = [f"{result['model']}, {result['micro']} x {result['tokens']} tokens, accumulation="
             f"{result['accumulation']}", "",
             "| layer | count | holds | GiB | Trainer GiB | B/param | held/Trainer |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['layer']} | {r['count']} | {r['holds']} | {r['gib']:.3f} | {r['trainer_gib']:.3f} | "
              f"{r['bytes_per_param']:.2f} | {r['worst']:.2f} |" for r in result["layers"]]
    lines += ["", f"held {result['held_gib']:.2f} GiB; an fp32 buffer for every fused layer "
              f"{result['buffer_gib']:.2f} GiB; a plain Trainer's weight gradients {result['grad_gib']:.2f} GiB"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=512, help="tokens a micro-batch")
    p.add_argument("--micro", type=int, default=4, help="micro-batches a step (1: clipping without accumulation)")
    p.add_argument("--accumulation", choices=ACCUMULATION_MODES, default="auto")
    p.add_argument("--out", help="also write the results as JSON here")
    opts = p.parse_args()
    if opts.tokens < 1 or opts.micro < 1:
        p.error(f"--tokens {opts.tokens} --micro {opts.micro}: give 1 or more")
    results = [held_rows(name, opts.tokens, opts.micro, opts.accumulation) for name in opts.models.split(",")]
    print("\n\n".join(map(markdown, results)))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
