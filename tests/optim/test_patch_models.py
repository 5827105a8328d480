"""patch_model on tiny models built from configs (no hub): the report is right, and three
AdamW steps with fused layers give the weights (every parameter) that the unpatched model
gets from torch.optim.AdamW(foreach=False). In the forge run a torch AdamW with the same
hyperparameters steps whatever has a .grad (the non-fused parameters and any layer that
fell back); fused weights have none, so it skips them."""

import contextlib
import copy
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from torch import nn
from transformers.models.esm.modeling_esmfold import EsmFoldLinear

from forge_hf.nn.linear import ForgeFallbackWarning
from forge_hf.optim.patch import EXPERT_TENSOR, FROZEN, TIED, patch_model

HP = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
STEPS = 3
VOCAB, BATCH, SEQ = 64, 2, 8
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


def lm_batch(gen):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return dict(input_ids=ids, labels=ids)


def cls_batch(gen):
    return dict(input_ids=torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                labels=torch.randint(0, 3, (BATCH,), generator=gen))


def image_batch(gen):
    return dict(pixel_values=torch.randn(BATCH, 3, 16, 16, generator=gen),
                labels=torch.randint(0, 3, (BATCH,), generator=gen))


def tiny_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


class Stack(nn.Module):
    """Two ``linear`` layers around a tanh, for nn.Linear subclasses outside a tiny model."""

    def __init__(self, linear):
        super().__init__()
        self.up, self.down = linear(16, 32), linear(32, 16)

    def forward(self, x):
        return types.SimpleNamespace(loss=self.down(torch.tanh(self.up(x))).square().mean())


def vector_batch(gen):
    return dict(x=torch.randn(BATCH, SEQ, 16, generator=gen))


def tiny_lora():
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)  # random A and B: both get a gradient at step 1
    return peft.get_peft_model(tiny_llama(), config)


@dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable = lm_batch
    fused: int = 0  # how many modules the report fuses
    skipped: dict = field(default_factory=dict)  # name -> reason, all of them
    falls_back: tuple = ()  # names that take the ordinary path in their steps (a weight read elsewhere)


def _per_layer(names, layers=2, prefix="model.layers.{}."):
    return [prefix.format(i) + n for i in range(layers) for n in names]


CASES = {
    "llama": Case(tiny_llama, fused=15),
    "qwen3": Case(lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=8)),
                  fused=15),
    "qwen3_moe": Case(
        lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
        fused=9,
        skipped={n: EXPERT_TENSOR for n in _per_layer(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])}),
    "phi3": Case(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0)), fused=9),
    "gemma": Case(lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=8)),
                  fused=14, skipped={"lm_head": TIED}),
    "gpt2": Case(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)), fused=8, skipped={"lm_head": TIED}),
    "bert": Case(lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)),
        batch=cls_batch, fused=14),
    "vit": Case(lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)),
        batch=image_batch, fused=13),
    # Mamba's torch path reads dt_proj.weight directly and never calls the module: the
    # report fuses it, the runtime check sends it back to the ordinary optimizer.
    "mamba": Case(lambda: transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
        fused=8, skipped={"lm_head": TIED},
        falls_back=tuple(f"backbone.layers.{i}.mixer.dt_proj" for i in range(2))),
    # nn.Linear subclasses that compute the plain map (optim/patch.py's _plain_type)
    "falcon": Case(lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0)), fused=8, skipped={"lm_head": TIED}),
    "esmfold_linear": Case(lambda: Stack(EsmFoldLinear), batch=vector_batch, fused=2),
    "lora": Case(tiny_lora, fused=8, skipped={
        f"base_model.model.{n}": FROZEN
        for n in ["lm_head"] + _per_layer(["self_attn.q_proj.base_layer", "self_attn.k_proj",
                                           "self_attn.v_proj.base_layer", "self_attn.o_proj", "mlp.gate_proj",
                                           "mlp.up_proj", "mlp.down_proj"])}),
}


@contextlib.contextmanager
def no_fallback():
    """A ForgeFallbackWarning becomes an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForgeFallbackWarning)
        yield


def build(case: Case, device="cpu") -> nn.Module:
    torch.manual_seed(0)
    return case.build().float().to(device)


def train(model, case: Case, steps=STEPS, record=None):
    """``steps`` AdamW steps over every trainable parameter; ``record`` collects each step's
    gradients by name (the torch run)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), foreach=False, **HP)
    gen = torch.Generator().manual_seed(1)
    device = next(iter(params.values())).device
    model.train()
    for _ in range(steps):
        model(**{k: v.to(device) for k, v in case.batch(gen).items()}).loss.backward()
        if record is not None:
            for n, p in params.items():
                record.setdefault(n, []).append(None if p.grad is None else p.grad.clone())
        opt.step()
        opt.zero_grad()


def round_off_driven(grads: dict) -> dict:
    """name -> mask of the entries whose gradient was, at some step, nonzero but below 1e-8
    of that step's largest gradient entry in the model. There the exact gradient is 0 (a
    key bias: softmax ignores it) and what is left is summation round-off (~1e-10 of the
    largest here), which Adam scales up to a full +-lr step in either run."""
    steps = len(next(iter(grads.values())))
    top = [max(g[i].abs().max() for g in grads.values() if g[i] is not None) for i in range(steps)]
    masks = {}
    for name, gs in grads.items():
        # an exact 0 (an embedding row not in the batch) is no round-off: it must match
        small = [(g != 0) & (g.abs() <= 1e-8 * t) for g, t in zip(gs, top) if g is not None]
        masks[name] = torch.stack(small).any(0) if small else None
    return masks


def assert_trained_alike(forge_model, torch_model, grads, steps=STEPS):
    """Every parameter as torch.optim.AdamW left it, to fp32 round-off, stated honestly:

    * an entry is off if it differs by more than 1e-5 of its tensor's largest entry (real
      entries are seen within 2e-6: only the token-axis summation order differs);
    * only entries whose gradient is round-off (round_off_driven, decided from the torch
      run alone) may be off: Adam moves them by up to ~lr per step in whatever direction
      the noise points, in either run, so they are bounded by 2 * steps * lr; and they
      must be under 1% of the model's trainable entries.
    """
    ours = dict(forge_model.named_parameters())
    noise = round_off_driven(grads)
    excused = total = 0
    for name, ref in torch_model.named_parameters():
        if not ref.requires_grad:
            assert torch.equal(ours[name], ref), f"frozen {name} changed"
            continue
        diff = (ours[name].detach() - ref.detach()).abs()
        off = diff > 1e-5 * ref.detach().abs().max()
        noisy = noise[name] if noise[name] is not None else torch.zeros_like(off)
        bad = off & ~noisy
        assert not bad.any(), (f"{name}: {int(bad.sum())} entries with a real gradient are off, by up to "
                               f"{(diff[bad].max() / ref.abs().max()).item():.2e} of the tensor scale")
        if off.any():
            assert diff[off].max() <= 2 * steps * HP["lr"], f"{name}: a round-off-driven entry moved too far"
        excused += int(off.sum())
        total += diff.numel()
    assert excused <= 0.01 * total, f"{excused} of {total} entries differ (round-off driven)"


def run_pair(case: Case, device="cpu", **patch_kwargs):
    """(report, forge model, torch model, torch gradients) after STEPS steps of the torch
    model; the forge model is patched, not yet trained."""
    torch_model = build(case, device)
    forge_model = copy.deepcopy(torch_model)
    report = patch_model(forge_model, min_params=0, **{"backend": "reference", **HP, **patch_kwargs})
    grads = {}
    train(torch_model, case, record=grads)
    return report, forge_model, torch_model, grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_report_and_three_steps_match_torch(name):
    case = CASES[name]
    with pytest.warns(ForgeFallbackWarning) if case.falls_back else no_fallback():
        report, forge_model, torch_model, grads = run_pair(case)
        train(forge_model, case)
    assert len(report.fused) == case.fused, str(report)
    assert report.skip_reasons() == case.skipped, str(report)
    assert report.fused_params == sum(m.params for m in report.fused) > 0
    assert report.gradient_bytes_saved == 4 * report.fused_params  # fp32 gradients
    modules = dict(forge_model.named_modules())
    for fused in report.fused:
        layer = modules[fused.name]
        # falls_back: a cause in every step, so on the ordinary path in each, never for good
        assert layer.forge_enabled, fused.name
        assert (layer.forge_fallback() is None) == (fused.name not in case.falls_back), fused.name
        if layer.forge_fallback() is None:
            assert layer.weight.grad is None and layer.forge_state.step == STEPS, fused.name
    assert sorted(m.layer_index for m in report.fused) == list(range(case.fused))
    assert_trained_alike(forge_model, torch_model, grads)


def test_triton_backend_on_llama(device):
    """The same run with the Triton kernel (interpreted on CPU, compiled on GPU)."""
    case = CASES["llama"]
    with no_fallback():
        report, forge_model, torch_model, grads = run_pair(case, device, backend="triton")
        train(forge_model, case)
    assert all(forge_model.get_submodule(m.name).forge_config.backend == "triton" for m in report.fused)
    assert_trained_alike(forge_model, torch_model, grads)
