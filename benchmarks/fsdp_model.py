"""The paper model of forge inside FSDP2 (docs/fsdp.md): per-rank memory and bytes sent per
step against FSDP2 + AdamW, and where gathering a layer's tokens stops being cheaper than
reduce-scattering its gradient. Arithmetic only, no GPU; prints markdown tables.

    python benchmarks/fsdp_model.py --model llama-3.1-8b --ranks 2,8,64,512 --tokens 512
    python benchmarks/fsdp_model.py --model llama-3.1-8b --tp 2,4 --tokens 2048   # TP against FSDP2

Assumptions (docs/fsdp.md says why): bf16 weights, activations and gradients; one FSDP2 unit
per decoder layer plus the root (embedding, final norm, lm_head), the root kept gathered
from forward to the end of backward (FSDP2's default for the root), the decoder layers
gathered again for backward with one unit prefetched; ring collectives, each rank sending
(W-1)/W of a reduce-scatter's or all-gather's whole buffer.
"""

import argparse

from models import SHAPES, linear_shapes

# too large to build on one GPU, so only here: models.py's table holds what the benchmarks build
SHAPES.setdefault("llama-3.1-70b", ("LlamaConfig", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                                       num_hidden_layers=80, num_attention_heads=64,
                                                       num_key_value_heads=8, tie_word_embeddings=False)))

BF16 = 2
GIB = 2**30
# optimizer state bytes per parameter: AdamW's two moments in fp32 (mixed precision), or in
# bf16 (torch's AdamW keeps them in a bf16 parameter's dtype); forge's two bf16 moments;
# forge's two int8 moments with their block scales (2.125 bytes)
ADAMW = "FSDP2 + AdamW"
STATE_BYTES = {f"{ADAMW}, fp32 states": 8.0, f"{ADAMW}, bf16 states": 4.0, "forge bf16": 4.0, "forge int8": 2.125}


def break_even(n_out: int, n_in: int) -> float:
    """in*out/(in+out): gathering a layer's tokens (x and dy, (W-1)*t*(in+out) elements sent a
    rank) moves fewer bytes than reduce-scattering its gradient ((W-1)/W*in*out) while W*t is below it."""
    return n_in * n_out / (n_in + n_out)


def model_parts(name: str) -> dict:
    kw = SHAPES[name][1]
    h, layers = kw["hidden_size"], kw["num_hidden_layers"]
    shapes = linear_shapes(name)  # (names, out, in, count in the model)
    decoder = [s for s in shapes if s[0] != "lm_head"]
    head = [s for s in shapes if s[0] == "lm_head"]
    layer_linear = sum(n * k * count for _, n, k, count in decoder) // layers
    layer_norms, embed = 2 * h, kw["vocab_size"] * h
    root = embed + h + sum(n * k for _, n, k, _ in head)  # embedding, final norm, lm_head
    total = root + layers * (layer_linear + layer_norms)
    return dict(shapes=shapes, layers=layers, layer_linear=layer_linear, layer_norms=layer_norms, embed=embed,
                root=root, total=total, head=head, h=h)


def per_rank(parts: dict, variant: str, world: int, tokens: int) -> dict:
    """Bytes a rank holds and sends in one step. ``variant``: a STATE_BYTES key; forge fuses
    every linear (lm_head included)."""
    forge = variant.startswith("forge")
    total, layers, w = parts["total"], parts["layers"], world
    fused = [(n, k, count) for _, n, k, count in parts["shapes"]] if forge else []
    fused_params = sum(n * k * count for n, k, count in fused)
    fused_head = forge and bool(parts["head"])
    head = sum(n * k for _, n, k, _ in parts["head"])
    unfused = total - fused_params
    # gradients that exist before their reduce-scatter: the root's (its one reduce-scatter comes
    # at the end of backward) and one decoder layer's
    root_grads = parts["root"] - (head if fused_head else 0)
    layer_grads = parts["layer_norms"] + (0 if forge else parts["layer_linear"])
    token_elems = [w * tokens * (n + k) for n, k, _ in fused]
    sent_tokens = sum((w - 1) * tokens * (n + k) * count for n, k, count in fused) * BF16
    layer = parts["layer_linear"] + parts["layer_norms"]
    return dict(
        weights=total * BF16 / w,
        states=total * STATE_BYTES[variant] / w,
        grad_shards=unfused * BF16 / w,
        gathered_weights=(parts["root"] + 2 * layer) * BF16,
        unsharded_grads=(root_grads + layer_grads) * BF16,
        gathered_tokens=max(token_elems, default=0) * BF16,
        # all-gathers: the decoder layers twice (forward, backward), the root once
        sent_weights=(w - 1) / w * (2 * layers * layer + parts["root"]) * BF16,
        sent_grads=(w - 1) / w * unfused * BF16,
        sent_tokens=sent_tokens,
    )


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def memory_table(parts: dict, ranks: list[int], tokens: int) -> str:
    head = ("| ranks | optimizer | weights | states | gradient shards | gathered weights | unsharded gradients "
            "| gathered tokens | total |")
    rows = [head, "|" + " --- |" * 9]
    for w in ranks:
        for variant in STATE_BYTES:
            m = per_rank(parts, variant, w, tokens)
            keys = ("weights", "states", "grad_shards", "gathered_weights", "unsharded_grads", "gathered_tokens")
            cells = [gib(m[k]) for k in keys]
            rows.append(f"| {w} | {variant} | " + " | ".join(cells) + f" | {gib(sum(m[k] for k in keys))} |")
    return "\n".join(rows)


def bytes_table(parts: dict, ranks: list[int], tokens: int) -> str:
    rows = ["| ranks | optimizer | weight all-gathers | gradient reduce-scatters | token gathers | total |",
            "|" + " --- |" * 6]
    for w in ranks:
        for variant, label in ((f"{ADAMW}, fp32 states", ADAMW), ("forge bf16", "forge")):  # states move no bytes
            m = per_rank(parts, variant, w, tokens)
            keys = ("sent_weights", "sent_grads", "sent_tokens")
            rows.append(f"| {w} | {label} | "
                        + " | ".join(gib(m[k]) for k in keys) + f" | {gib(sum(m[k] for k in keys))} |")
    return "\n".join(rows)


def crossover_table(parts: dict, tokens: int) -> str:
    rows = [f"| layer | out x in | in*out/(in+out) | break-even ranks at {tokens} tokens |", "|" + " --- |" * 4]
    for names, n, k, _ in parts["shapes"]:
        c = break_even(n, k)
        rows.append(f"| {names} | {n} x {k} | {c:.0f} | {c / tokens:.2f} |")
    return "\n".join(rows)


# ------------------------------------------------------------ tensor parallelism (docs/parallelism.md)
# transformers' Llama plan: q/k/v/gate/up colwise, o/down rowwise, the embedding split by vocabulary,
# lm_head colwise with its output gathered; norms replicated. Every rank holds 1/T of each linear
# and of the embedding, and sees the whole batch.


def activations(kw: dict, tokens: int, tp: int) -> float:
    """bf16 bytes one rank saves for backward at ``tokens`` tokens: per decoder layer the
    replicated inputs of both norms and of the colwise linears (one tensor for q/k/v, one for
    gate/up), the attention's q, k, v and output and the MLP's gate, up and product, split over
    ``tp``; then the gathered logits, bf16 and their fp32 copy for the loss."""
    h, ffn, layers = kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"]
    head_dim = kw.get("head_dim", h // kw["num_attention_heads"])
    q, kv = kw["num_attention_heads"] * head_dim, kw["num_key_value_heads"] * head_dim
    layer = 4 * h + (2 * q + 2 * kv + 3 * ffn) / tp
    return tokens * (layers * layer * BF16 + kw["vocab_size"] * (BF16 + 4))


def tp_per_rank(parts: dict, kw: dict, variant: str, tp: int, tokens: int) -> dict:
    """Bytes one rank of a tensor-parallel group of ``tp`` holds. ``variant``: a STATE_BYTES key
    (forge fuses every linear: no gradient of them; AdamW: each piece's bf16 gradient)."""
    norms = parts["layers"] * parts["layer_norms"] + parts["h"]
    pieces = (parts["total"] - norms) / tp  # the linears and the embedding
    held = pieces + norms
    linears = sum(n * k * count for _, n, k, count in parts["shapes"]) / tp
    grads = held - linears if variant.startswith("forge") else held
    return dict(weights=held * BF16, states=held * STATE_BYTES[variant], gradients=grads * BF16,
                activations=activations(kw, tokens, tp))


def tp_memory_table(parts: dict, kw: dict, tps: list[int], tokens: int) -> str:
    """TP over T ranks against FSDP2 over as many (each rank its own ``tokens``)."""
    rows = ["| ranks | parallelism | optimizer | weights | states | gradients | gathered weights | activations "
            "| total |", "|" + " --- |" * 9]
    for t in tps:
        for variant in (f"{ADAMW}, fp32 states", "forge bf16"):
            label = "AdamW, fp32 states" if variant.startswith(ADAMW) else variant
            m = tp_per_rank(parts, kw, variant, t, tokens)
            cells = [m["weights"], m["states"], m["gradients"], 0.0, m["activations"]]
            rows.append(f"| {t} | TP {t} | {label} | " + " | ".join(gib(c) for c in cells) + f" | {gib(sum(cells))} |")
            f = per_rank(parts, variant, t, tokens)
            cells = [f["weights"], f["states"], f["grad_shards"] + f["unsharded_grads"], f["gathered_weights"],
                     activations(kw, tokens, 1) + f["gathered_tokens"]]
            rows.append(f"| {t} | FSDP2 {t} | {label} | " + " | ".join(gib(c) for c in cells)
                        + f" | {gib(sum(cells))} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--ranks", default="2,8,64,512", help="comma-separated world sizes")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank and step")
    parser.add_argument("--tp", default="", help="comma-separated tensor-parallel sizes: per-rank memory under TP "
                                                 "against FSDP2 over as many ranks (activations at --tokens)")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    tps = [int(t) for t in args.tp.split(",")] if args.tp else []
    if args.tokens < 1 or any(r < 1 for r in ranks + tps):
        parser.error(f"--tokens {args.tokens} --ranks {args.ranks} --tp {args.tp}: use positive integers")
    if tps:
        parts = model_parts(args.model)
        print(f"### {args.model} under tensor parallelism: {args.tokens} tokens per rank\n")
        print(f"Memory per rank (GiB):\n\n{tp_memory_table(parts, SHAPES[args.model][1], tps, args.tokens)}")
        return
    parts = model_parts(args.model)
    print(f"### {args.model}: {parts['total'] / 1e9:.2f}B parameters, {args.tokens} tokens per rank\n")
    print(f"Memory per rank (GiB):\n\n{memory_table(parts, ranks, args.tokens)}\n")
    print(f"Bytes sent per rank and step (GiB):\n\n{bytes_table(parts, ranks, args.tokens)}\n")
    print(f"Crossover:\n\n{crossover_table(parts, args.tokens)}")


if __name__ == "__main__":
    main()
