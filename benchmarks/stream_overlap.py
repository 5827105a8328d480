"""The gate of the update across streams (issue: the update off the tensor cores' critical
path, route 2): the backward of one decoder layer of a model, its linears fused, with each
layer's weight gradient formed by cuBLAS into a ring of fp32 buffers and its rule pass run on
a side stream, while the main stream goes on with the input gradients and attention's
backward. Timed beside the same backward with torch's own weight gradients and no update,
beside cuBLAS's weight-gradient GEMMs alone, and beside forge's paths on the main stream:

    autograd    the layer's plain backward: cuBLAS's bf16 weight gradients, no update
    wgrad       those weight-gradient GEMMs alone (bf16 dY^T X, as autograd forms them)
    two_pass    forge, FORGE_HF_WGRAD=two_pass: the fp32 gradient, then the rule, on the main stream
    streams     the two-pass path on a side stream, into a ring of --ring fp32 buffers
    fused       forge, FORGE_HF_WGRAD=fused: the fused kernel select.choose names

The gate: streams <= autograd + a quarter of wgrad. The streams arm's weights are checked
equal, bit for bit, to the two_pass arm's after the same steps (the same rule pass, run
later). One row per arm goes to the results table (tool stream_overlap).

    python benchmarks/stream_overlap.py --model llama-3.1-8b --tokens 2048
"""

import argparse
import os
import statistics

import torch

import forge_hf
from forge_hf.kernels import GradientScratch, dispatch

from models import SHAPES
from results_table import add_table_option, append_rows

ARMS = ("autograd", "wgrad", "two_pass", "streams", "fused")


def decoder_layer(model: str, seed: int = 0, **overrides):
    """One decoder layer of ``model``'s shape (random bf16 weights) and its rotary embedding."""
    import transformers

    cls, kw = SHAPES[model]
    config = getattr(transformers, cls)(**{**kw, **overrides}, attn_implementation="sdpa")
    family = {"LlamaConfig": "llama", "Qwen3Config": "qwen3"}[cls]
    module = getattr(transformers.models, family)
    prefix = {"llama": "Llama", "qwen3": "Qwen3"}[family]
    modeling = getattr(module, f"modeling_{family}")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        layer = getattr(modeling, f"{prefix}DecoderLayer")(config, 0).to(torch.bfloat16)
        rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    return layer, rotary, config


class SideStreamTwoPass:
    """dispatch's two-pass binding, run on one side stream into a ring of fp32 buffers: the
    main stream goes on once the layer's input gradient is formed. The tokens are kept alive
    for the side stream (record_stream); the ring's buffers are reused in order on that one
    stream, so a buffer is rewritten only after its rule pass has read it."""

    def __init__(self, ring: int, device):
        self.stream = torch.cuda.Stream(device)
        self.scratches = [GradientScratch(device) for _ in range(ring)]
        self.turn = 0
        self.original = dispatch._bind_two_pass

    def bind(self, weight, slots, rule_name, stochastic, scratch):
        scratches = self.scratches
        passes = [self.original(weight, slots, rule_name, stochastic, s) for s in scratches]
        ring = self

        def two_pass(x, dy, args, stats):
            main = torch.cuda.current_stream()
            ring.stream.wait_stream(main)
            turn, ring.turn = ring.turn, (ring.turn + 1) % len(scratches)
            with torch.cuda.stream(ring.stream):
                passes[turn](x, dy, args, stats)
            for t in (x, dy, args, stats):
                t.record_stream(ring.stream)
        return two_pass

    def grow(self, numel: int) -> None:
        for s in self.scratches:
            s.view(1, numel)  # grown before timing: a growth synchronises the device

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.scratches)


def timed_backwards(layer, rotary, hidden, grad_out, steps: int, warmup: int, side=None) -> list[float]:
    """ms of each backward (forward untimed), from its start on the main stream to the end
    of everything it queued, the side stream's rule passes included."""
    position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
    cos_sin = rotary(hidden, position_ids)
    times = []
    for i in range(warmup + steps):
        for p in layer.parameters():
            p.grad = None
        out = layer(hidden, position_embeddings=cos_sin, position_ids=position_ids)
        out = out[0] if isinstance(out, tuple) else out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.backward(grad_out)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side.stream)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def wgrad_times(layer, tokens: int, steps: int, warmup: int) -> list[float]:
    """ms of the layer's weight-gradient GEMMs alone, as autograd forms them (bf16 dY^T X)."""
    pairs = []
    for m in layer.modules():
        if isinstance(m, torch.nn.Linear):
            n, k = m.weight.shape
            pairs.append((torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16),
                          torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)))
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for dy, x in pairs:
            torch.mm(dy.t(), x)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def run_arm(arm: str, opts, overrides: dict) -> tuple[list[float], dict, torch.Tensor | None]:
    """(times, extra row fields, the layer's weights after the steps, forge arms only)."""
    layer, rotary, config = decoder_layer(opts.model, **overrides)
    if arm == "wgrad":
        return wgrad_times(layer, opts.tokens, opts.steps, opts.warmup), {}, None
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(1, opts.tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    hidden.requires_grad_(True)
    grad_out = torch.randn(hidden.shape, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    if arm == "autograd":
        return timed_backwards(layer, rotary, hidden, grad_out, opts.steps, opts.warmup), {}, None
    os.environ["FORGE_HF_WGRAD"] = "fused" if arm == "fused" else "two_pass"
    side = None
    if arm == "streams":
        side = SideStreamTwoPass(opts.ring, hidden.device)
        side.grow(max(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear)))
        dispatch._bind_two_pass = side.bind
    try:
        forge_hf.patch_model(layer, state_precision=opts.state, lr=1e-5, weight_decay=0.01, seed=0)
        times = timed_backwards(layer, rotary, hidden, grad_out, opts.steps, opts.warmup, side)
    finally:
        dispatch._bind_two_pass = side.original if side else dispatch._bind_two_pass
        os.environ.pop("FORGE_HF_WGRAD")
        dispatch.reset_wgrad_choices()
    weights = torch.cat([p.detach().flatten() for p in layer.parameters()])
    extra = {"note": f"ring of {opts.ring} fp32 buffers, {side.nbytes / 2**30:.2f} GiB"} if side else {}
    return times, extra, weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--state", default="bf16", help="the forge arms' state_precision")
    p.add_argument("--ring", type=int, default=2, help="fp32 gradient buffers of the streams arm")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--overrides", default="", help="config fields, e.g. hidden_size=256,intermediate_size=512")
    add_table_option(p)
    opts = p.parse_args()
    arms = opts.arms.split(",")
    if set(arms) - set(ARMS) or opts.ring < 1:
        p.error(f"--arms {opts.arms} --ring {opts.ring}: arms from {list(ARMS)}, a ring of 1 or more")
    if not torch.cuda.is_available():
        raise SystemExit("stream_overlap times CUDA streams: run it on a GPU")
    overrides = {k: int(v) for k, v in (item.split("=") for item in opts.overrides.split(",") if item)}
    rows, medians, weights = [], {}, {}
    for arm in arms:
        times, extra, weights[arm] = run_arm(arm, opts, overrides)
        q = statistics.quantiles(times, n=4)
        medians[arm] = statistics.median(times)
        row = dict(model=f"{opts.model}-decoder-layer", batch=f"1x{opts.tokens}", arm=f"stream_overlap_{arm}",
                   tool="stream_overlap", step_ms=medians[arm], spread_ms=q[2] - q[0],
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, **extra)
        row["note"] = "; ".join(filter(None, (row.get("note"), f"state {opts.state}" * (arm in ("two_pass",
                                "streams", "fused")), f"{len(times)} backwards after {opts.warmup}; IQR")))
        print(row, flush=True)
        rows.append(row)
        torch.cuda.reset_peak_memory_stats()
    if weights.get("two_pass") is not None and weights.get("streams") is not None:
        same = torch.equal(weights["two_pass"], weights["streams"])
        print(f"streams arm's weights bit-identical to the two_pass arm's: {same}")
        for row in rows:
            if row["arm"] == "stream_overlap_streams":
                row["note"] += f"; weights {'bit-identical to' if same else 'DIFFER from'} two_pass's"
    if {"autograd", "wgrad", "streams"} <= set(medians):
        bound = medians["autograd"] + medians["wgrad"] / 4
        verdict = "passes" if medians["streams"] <= bound else "misses"
        print(f"gate: streams {medians['streams']:.3f} ms against autograd + wgrad/4 = {bound:.3f} ms: {verdict}")
    append_rows(rows, opts.table)


if __name__ == "__main__":
    main()
