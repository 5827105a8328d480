"""recompute_swiglu: a SwiGLU MLP whose fused down_proj keeps gate and up only trains
bit for bit as the MLP's own autograd does, and saves two tensors fewer per layer."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import forge_hf
from forge_hf.nn.swiglu import recompute_swiglu, restore_swiglu
from tests.helpers import DEVICE

VOCAB, SEQ, INTERMEDIATE = 64, 12, 80


def tiny_llama(hidden_act="silu"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, use_cache=False, hidden_act=hidden_act)
    return LlamaForCausalLM(config).to(DEVICE)


def patched(dtype, backend, recompute):
    model = tiny_llama().to(dtype)
    forge_hf.patch_model(model, optimizer="adamw", state_precision="fp32", min_params=0, backend=backend,
                         lr=1e-2, weight_decay=0.1)
    if recompute:
        assert recompute_swiglu(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    return model, forge_hf.ForgeOptimizer(model)


def _ids(seed):
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.bfloat16, True)])
def test_recomputed_swiglu_trains_bit_for_bit_as_autograd(dtype, autocast, backend, single_thread):
    runs = []
    for recompute in (False, True):
        model, opt = patched(dtype, backend, recompute)
        losses = []
        for step in range(3):
            ids = _ids(step)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses, params), (losses_r, params_r) = runs
    assert losses == losses_r
    for a, b in zip(params, params_r):
        assert torch.equal(a, b)


def test_up_gets_its_gradient_when_gate_needs_none(single_thread):
    """A frozen gate_proj on an input that needs no gradient: only up carries one back, and
    up_proj is stepped as without the recompute."""
    runs = []
    for recompute in (False, True):
        model = tiny_llama()
        for name, p in model.named_parameters():  # everything up to layer 0's MLP, and its gate
            if not name.startswith("model.layers.0.mlp") or "gate_proj" in name:
                if name.startswith(("model.embed_tokens", "model.layers.0.")):
                    p.requires_grad_(False)
        forge_hf.patch_model(model, optimizer="adamw", state_precision="fp32", min_params=0, backend="reference",
                             lr=1e-2)
        if recompute:
            recompute_swiglu(model)
        opt = forge_hf.ForgeOptimizer(model)
        ids = _ids(0)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        runs.append(model.model.layers[0].mlp.up_proj.weight.detach().clone())
    start = tiny_llama().model.layers[0].mlp.up_proj.weight
    assert not torch.equal(runs[0], start)  # stepped
    assert torch.equal(runs[0], runs[1])


def _saved_bytes(model, ids) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    del loss
    return sum(storages.values())


def test_it_saves_the_product_and_the_activation_of_every_mlp(single_thread):
    ids = _ids(0)
    plain, _ = patched(torch.float32, "reference", recompute=False)
    recomputed, _ = patched(torch.float32, "reference", recompute=True)
    saved = _saved_bytes(plain, ids) - _saved_bytes(recomputed, ids)
    per_tensor = ids.numel() * INTERMEDIATE * 4
    assert saved == 2 * 2 * per_tensor  # two layers: silu(gate) and the product each


def test_eval_and_restore_give_the_mlp_its_own_forward(single_thread):
    model, _ = patched(torch.float32, "reference", recompute=True)
    ids = _ids(1)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert restore_swiglu(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "forward" not in model.model.layers[0].mlp.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, out)
    forge_hf.unpatch_model(model)
    assert restore_swiglu(model) == []


def test_it_refuses_models_it_cannot_change():
    with pytest.raises(ValueError, match="call patch_model first"):
        recompute_swiglu(tiny_llama())
    gelu = tiny_llama(hidden_act="gelu")
    forge_hf.patch_model(gelu, min_params=0, backend="reference")
    with pytest.raises(ValueError, match="hidden_act 'silu'"):
        recompute_swiglu(gelu)
    assert recompute_swiglu(gelu, required=False) == []  # ForgeTrainer's recompute_swiglu=auto: nothing to do
    assert "forward" not in gelu.model.layers[0].mlp.__dict__
