"""Real-shaped models from their public configs, random weights, built on the GPU in bf16."""

import torch

QWEN3 = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
             num_key_value_heads=8, rms_norm_eps=1e-6)
SHAPES = {
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
                                       tie_word_embeddings=False)),
    "qwen3-0.6b": ("Qwen3Config", dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                     num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen3Config", dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, tie_word_embeddings=True)),
    "qwen3-8b": ("Qwen3Config", dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, tie_word_embeddings=False)),
    "qwen3-14b": ("Qwen3Config", dict(QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                    num_attention_heads=40, tie_word_embeddings=False)),
    "qwen3-32b": ("Qwen3Config", dict(QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                    num_attention_heads=64, tie_word_embeddings=False)),
}


def linear_shapes(name: str) -> list[tuple[str, int, int, int]]:
    """(names, out_features, in_features, count in the model) of each distinct shape of the
    model's linear weights: the decoder layers', and lm_head unless it is tied to the embedding."""
    kw = SHAPES[name][1]
    h, ffn = kw["hidden_size"], kw["intermediate_size"]
    head_dim = kw.get("head_dim", h // kw["num_attention_heads"])
    q, kv = kw["num_attention_heads"] * head_dim, kw["num_key_value_heads"] * head_dim
    layer = [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
             ("gate_proj", ffn, h), ("up_proj", ffn, h), ("down_proj", h, ffn)]
    names: dict[tuple[int, int], list[str]] = {}
    for proj, n, k in layer:
        names.setdefault((n, k), []).append(proj)
    shapes = [("/".join(p), n, k, kw["num_hidden_layers"] * len(p)) for (n, k), p in names.items()]
    if not kw["tie_word_embeddings"]:
        shapes.append(("lm_head", kw["vocab_size"], h, 1))
    return shapes


def apply_liger(model, cross_entropy=True) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels on ``model`` (they save less for backward)
    and its cross-entropy (the logits' gradient written in place of the logits; Liger sets
    it process-wide, for every model built later; it reads a count on the host, so a CUDA
    graph cannot capture it). Not its fused linear cross-entropy: the logits' head stays
    an ordinary linear that forge can fuse."""
    import liger_kernel.transformers as liger

    apply = {"llama": liger.apply_liger_kernel_to_llama, "qwen3": liger.apply_liger_kernel_to_qwen3}
    apply[model.config.model_type](rope=True, rms_norm=True, swiglu=True, cross_entropy=cross_entropy,
                                   fused_linear_cross_entropy=False, model=model)


def build_model(name: str, device="cuda", dtype=torch.bfloat16, attn="sdpa", seed=0, liger=False,
                liger_ce=True, **overrides):
    """``liger``: Liger's kernels (``liger_ce``: its cross-entropy too). ``overrides``: config
    fields to change (a dry-run size, fewer layers)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: choose one of {sorted(SHAPES)}")
    import transformers

    cls, kw = SHAPES[name]
    config = getattr(transformers, cls)(**{**kw, **overrides}, attn_implementation=attn)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: seconds, not minutes, for 8B
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if liger:
        apply_liger(model, cross_entropy=liger_ce)
    model.train()
    return model
