"""Exact gradient accumulation and global-norm clipping (nn/held_gradient.py,
ForgeOptimizer(accumulate=..., max_grad_norm=...)): k micro-batches held by the fused layers
and stepped at ``step()`` against torch.optim on an unpatched copy that sums the k
gradients, with and without clipping, every rule, stash and buffer; fp32 weights and
state on the reference backend (CPU), to fp32 round-off."""


import copy

import pytest
import torch

from forge_hf.core.rules import RULES
from forge_hf.nn.held_gradient import HeldGradient, trainer_bytes
from forge_hf.optim.optimizer import ForgeOptimizer
from forge_hf.optim.patch import patch_model
from tests.helpers import DEVICE, bf16_ulps_apart
from tests.helpers import tiny_llama as small_llama
from tests.optim.test_optimizer import VOCAB, assert_models_close, batches, torch_twin

K = 3  # micro-batches a step
# The stash sums the K micro-batches' products in one GEMM where torch adds K gradients: the
# token-axis sum in another order, its round-off grown by the rules' division by sqrt(v) (and
# RMSprop's and Adagrad's lack of bias correction); the buffer adds K gradients as torch does, each
# formed by its own GEMM call.
RTOL_ACCUMULATED = {"stash": 1e-4, "buffer": 5e-5}

TORCH_RULES = {
    "adamw": (torch.optim.AdamW, dict(lr=2e-3, weight_decay=0.01)),
    "nadam": (torch.optim.NAdam, dict(lr=2e-3, weight_decay=0.0)),
    "radam": (torch.optim.RAdam, dict(lr=2e-3, weight_decay=0.0)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, weight_decay=0.0, momentum=0.9)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, weight_decay=0.0)),
    "sgd": (torch.optim.SGD, dict(lr=1e-2, weight_decay=0.0, momentum=0.9)),
}


def odd_llama(seed=0):
    """A Llama whose linears are not multiples of the kernels' 64-wide tiles."""
    return small_llama(VOCAB, hidden=40, intermediate=72, seed=seed)


def patched_pair(rule, accumulation, **options):
    model, reference = odd_llama(), odd_llama()
    patch_model(model, optimizer=rule, backend="reference", min_params=0, accumulation=accumulation)
    return model, reference


def run(model, optimizer, steps, micro=K, after_step=None):
    """``steps`` optimizer steps of ``micro`` micro-batches, each loss divided by ``micro``."""
    losses = []
    for s in range(steps):
        for ids in batches(micro, seed=10 * s + 1):
            loss = model(input_ids=ids, labels=ids).loss / micro
            loss.backward()
            losses.append(loss.item())
        if after_step is not None:
            after_step()
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("rule", list(TORCH_RULES))
@pytest.mark.parametrize("accumulation", ["stash", "buffer"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05, 1e3])  # no clipping, clipping active, not active
def test_accumulated_steps_equal_torch_summing_the_gradients(rule, accumulation, max_grad_norm):
    cls, hyper = TORCH_RULES[rule]
    model, reference = patched_pair(rule, accumulation)
    optimizer = ForgeOptimizer(model, accumulate=True, max_grad_norm=max_grad_norm, **hyper)
    twin = torch_twin(reference, cls, **dict(hyper))
    norms = []

    def clip():
        if max_grad_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm))

    forge_losses = run(model, optimizer, steps=3)
    reference_losses = run(reference, twin, steps=3, after_step=clip)
    assert forge_losses == pytest.approx(reference_losses, rel=1e-5)
    if max_grad_norm:
        torch.testing.assert_close(optimizer.last_grad_norm, norms[-1], rtol=1e-5, atol=0)
        assert (norms[-1] > max_grad_norm) == (max_grad_norm < 1)  # the clip is active where it should be
    # Adagrad's first step divides a weight's gradient by its own magnitude: where the K
    # micro-batches' products nearly cancel, the order of their sum moves the update most
    rtol = RTOL_ACCUMULATED[accumulation] * (2 if rule == "adagrad" else 1)
    assert_models_close(model, reference, rtol=rtol)
    held = [m.forge_held for m in model.modules() if getattr(m, "forge_held", None) is not None]
    assert held and all(h.empty for h in held)


def test_k_micro_steps_equal_one_step_on_the_concatenated_batch():
    model, one = patched_pair("adamw", "stash")
    patch_model(one, optimizer="adamw", backend="reference", min_params=0)
    accumulated = ForgeOptimizer(model, lr=2e-3, accumulate=True)
    plain = ForgeOptimizer(one, lr=2e-3)
    for s in range(2):
        micro = batches(K, seed=s + 1)
        for ids in micro:
            (model(input_ids=ids, labels=ids).loss / K).backward()
        accumulated.step()
        accumulated.zero_grad()
        whole = torch.cat(micro)
        one(input_ids=whole, labels=whole).loss.backward()  # the mean over K equal-sized batches
        plain.step()
        plain.zero_grad()
    assert_models_close(model, one)


def test_clipping_at_one_micro_step_holds_until_step():
    """max_grad_norm alone (no accumulation): the backward steps nothing; step() clips and steps."""
    model, reference = patched_pair("adamw", "auto")
    optimizer = ForgeOptimizer(model, lr=2e-3, weight_decay=0.01, max_grad_norm=0.05)
    twin = torch_twin(reference, torch.optim.AdamW, lr=2e-3, weight_decay=0.01)
    ids = batches(1)[0]
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    model(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # held, not stepped
    optimizer.step()
    reference(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    twin.step()
    assert_models_close(model, reference)


@pytest.mark.parametrize("weight_dtype,rows_dtype,stashed,buffer", [
    (torch.bfloat16, torch.bfloat16, 1, torch.bfloat16),  # 4480 B of rows a micro-batch, bound 5760: bf16 past it
    (torch.float32, torch.bfloat16, 2, torch.float32),  # autocast's bf16 rows, bound 11520: the exact fp32 buffer
    (torch.float32, torch.float32, 1, torch.float32),  # fp32 rows: 8960 B a micro-batch
])
def test_auto_stashes_up_to_the_trainers_gradient_then_moves_to_a_buffer(weight_dtype, rows_dtype, stashed, buffer):
    """auto holds at most the layer's gradient in the weight's dtype (a plain Trainer's): the
    stash while its rows fit, then the fp32 buffer where it fits (fp32 weights), else bf16."""
    layer_in, layer_out = 40, 72
    bound = trainer_bytes(layer_in, layer_out, weight_dtype)
    held = HeldGradient("auto", weight_dtype)
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(20, layer_in, generator=gen).to(rows_dtype),
              torch.randn(20, layer_out, generator=gen).to(rows_dtype)) for _ in range(3)]
    for i, (x, dy) in enumerate(pairs):
        held.add(x, dy)
        assert (held.buffer is None) == (i < stashed), i
        assert held.nbytes() <= bound, i
    assert held.stash == [] and held.buffer.dtype == buffer and held.nbytes() <= bound
    expected = sum(dy.double().t() @ x.double() for x, dy in pairs)
    if buffer == torch.float32:
        torch.testing.assert_close(held.buffer.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # rounded at each add from the switch on, each within a bf16 step of the sum it rounds
        sums = [sum(dy.double().t() @ x.double() for x, dy in pairs[:n]) for n in range(stashed + 1, 4)]
        steps = sum(s.abs() for s in sums) * 2.0**-7 * (1 + 2.0**-6)
        assert ((held.buffer.double() - expected).abs() <= steps).all()
    stash = HeldGradient("stash", weight_dtype)
    for x, dy in pairs:
        stash.add(x, dy)
    assert stash.buffer is None and stash.nbytes() == 60 * (layer_in + layer_out) * pairs[0][0].element_size()
    torch.testing.assert_close(stash.squared_norm().double(), expected.square().sum(), rtol=1e-5, atol=0)


def bf16_run(accumulation, backend="reference", steps=2, device="cpu"):
    """A bf16 Llama, K micro-batches a step with an active clip: its model, optimizer, and the
    largest held bytes any fused layer had after a backward over its Trainer bound."""
    model = odd_llama().to(device, torch.bfloat16)
    patch_model(model, optimizer="adamw", backend=backend, min_params=0, accumulation=accumulation)
    optimizer = ForgeOptimizer(model, lr=2e-3, weight_decay=0.01, accumulate=True, max_grad_norm=0.05)
    layers = [m for m in model.modules() if getattr(m, "forge_held", None) is not None]
    worst, norms, kinds = 0.0, [], set()
    for s in range(steps):
        for ids in batches(K, seed=10 * s + 1):
            ids = ids.to(device)
            (model(input_ids=ids, labels=ids).loss / K).backward()
            for m in layers:
                held = m.forge_held
                worst = max(worst, held.nbytes() / trainer_bytes(m.in_features, m.out_features, m.weight.dtype))
                kinds.add("stash" if held.buffer is None else str(held.buffer.dtype))
        optimizer.step()
        optimizer.zero_grad()
        norms.append(optimizer.last_grad_norm)
    return model, torch.stack(norms), worst, kinds


def test_bf16_weights_hold_a_rounded_bf16_buffer_within_the_trainers_bytes():
    """bf16 weights under auto: 64 tokens a micro-batch pass the 40 x 72 layers' bound (25
    tokens of rows), so they hold a bf16 buffer, never more than the bf16 gradient; clipped and
    stepped from it, the run follows the exact fp32 buffer's (accumulation='buffer') to bf16
    round-off: the norms to a few bf16 steps; the weights mostly to the same bits, the others
    apart by less than two AdamW updates a step (a gradient near zero may change its sign)."""
    lean, lean_norms, lean_worst, lean_kinds = bf16_run("auto")
    exact, exact_norms, exact_worst, exact_kinds = bf16_run("buffer")
    assert lean_kinds == {"torch.bfloat16"} and lean_worst <= 1.0
    assert exact_kinds == {"torch.float32"} and exact_worst == 2.0  # what auto no longer holds
    assert (lean_norms > 0.05).all()  # the clip is active
    torch.testing.assert_close(lean_norms, exact_norms, rtol=2e-2, atol=0)
    moved = same = 0
    for (name, a), b in zip(lean.named_parameters(), exact.parameters()):
        assert (a.float() - b.float()).abs().max() <= 2 * 2 * 2e-3, name
        moved, same = moved + a.numel(), same + (a == b).sum().item()
    assert same / moved > 0.8


def test_a_bf16_buffer_steps_alike_on_both_backends():
    """The Triton backend (the kernel rounds the buffer; interpreted on CPU) against the reference:
    the same rounding bits, so the held buffers' norms agree to fp32 round-off."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on a GPU where there is one
    runs = [bf16_run("bf16_buffer", backend, steps=1, device=device) for backend in ("reference", "triton")]
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=0)
    for (name, a), b in zip(runs[0][0].named_parameters(), runs[1][0].parameters()):
        assert bf16_ulps_apart(a, b).max() <= 1, name


def test_a_bf16_buffer_is_refused_where_it_cannot_serve():
    model = odd_llama()  # fp32 weights: their fp32 buffer is exact at the bound
    patch_model(model, optimizer="adamw", backend="reference", min_params=0, accumulation="bf16_buffer")
    with pytest.raises(ValueError, match=r"^accumulation='bf16_buffer' rounds model\.layers\.0\.self_attn\.q_proj's "
                                         r"held gradient to bf16, but its weight is torch\.float32.*: use "
                                         r"accumulation='buffer' or 'auto'$"):
        ForgeOptimizer(model, accumulate=2)
    ForgeOptimizer(model)  # holding nothing, it asks for no buffer
    x, dy = torch.randn(4, 8).bfloat16(), torch.randn(4, 6).bfloat16()
    with pytest.raises(RuntimeError, match="accumulation='bf16_buffer' is not supported with forge's data "
                                           "parallelism.*use accumulation='stash' or 'auto'"):
        HeldGradient("bf16_buffer", torch.bfloat16).add(x, dy, gathered=True)


@pytest.mark.parametrize("tokens", [30, 300])  # 30: through tokens x tokens products; 300: the gradient's bands
def test_a_stash_norm_is_the_gradient_norm(tokens, monkeypatch):
    """The clip's squared norm of a stash, against float64, either way it is formed: below
    in·out/(in+out) tokens as <X X^T, dY dY^T>, above it from bands of the gradient (here 40 rows)."""
    monkeypatch.setattr("forge_hf.nn.held_gradient.NORM_CHUNK", 40 * 72)
    layer_in, layer_out = 72, 96
    gen = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(tokens, layer_in, generator=gen), torch.randn(tokens, layer_out, generator=gen))
             for _ in range(2)]
    held = HeldGradient("stash")
    for x, dy in pairs:
        held.add(x, dy)
    exact = sum(dy.double().t() @ x.double() for x, dy in pairs).square().sum()
    torch.testing.assert_close(held.squared_norm().double(), exact, rtol=1e-5, atol=0)


def test_an_input_several_layers_hold_is_concatenated_once():
    """q/k/v's (or gate/up's) input over two micro-batches: one concatenated tensor for every
    layer that holds it, and one tokens x tokens product of it."""
    xs = [torch.randn(5, 64), torch.randn(5, 64)]  # 10 tokens x (64 + 96) < 64 x 96: through products
    layers = [HeldGradient("stash") for _ in range(3)]
    for x in xs:
        for held in layers:
            held.add(x, torch.randn(5, 96))
    joined, grams = {}, {}
    norms = [held.squared_norm(joined, grams) for held in layers]
    x2 = layers[0].stash[0][0]
    assert all(held.stash[0][0] is x2 for held in layers) and len(joined) == 1 and grams["rows"] is x2
    for held, norm in zip(layers, norms):
        torch.testing.assert_close(norm, (held.stash[0][1].t() @ x2).square().sum())


def test_bad_settings_are_refused():
    model = odd_llama()
    patch_model(model, optimizer="adamw", backend="reference", min_params=0)
    with pytest.raises(ValueError, match=r"max_grad_norm=-1.0: give a number >= 0"):
        ForgeOptimizer(model, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="unknown accumulation='sometimes'"):
        patch_model(odd_llama(), optimizer="adamw", accumulation="sometimes")


def test_the_micro_batches_a_step_are_the_optimizers_one_count():
    """accumulate: False is 1, k is k, True leaves the count to the first loop that gives one
    (GraphedStep, ForgeTrainer); agree_accumulation is the one check of a loop's count."""
    def built(accumulate):
        model = odd_llama()
        patch_model(model, optimizer="adamw", backend="reference", min_params=0)
        return ForgeOptimizer(model, accumulate=accumulate)

    for bad in (0, -2, 1.5, "2"):
        with pytest.raises(ValueError, match=f"accumulate={bad!r}: give the micro-batches a step"):
            built(bad)
    plain, four, loop = built(False), built(4), built(True)
    assert (plain.accumulation_steps, plain.accumulate, plain.holds_updates) == (1, False, False)
    assert (four.accumulation_steps, four.accumulate, four.holds_updates) == (4, 4, True)
    assert loop.accumulate is True and loop.holds_updates
    assert plain.agree_accumulation(1) is None and four.agree_accumulation(4) is None
    assert "build it with ForgeOptimizer(model, ..., accumulate=True) or accumulate=2" in plain.agree_accumulation(2)
    assert four.agree_accumulation(2, "gradient_accumulation_steps") == (
        "gradient_accumulation_steps=2, but the ForgeOptimizer was built with accumulate=4")
    assert loop.agree_accumulation(3) is None and loop.accumulation_steps == 3  # the loop's count, from now on
    assert loop.agree_accumulation(2) is not None
    layer = next(m for m in four.param_groups[0]["params"] if m in four._layers)
    assert four._layers[layer].forge_held is not None


def test_without_accumulation_or_clipping_the_backward_steps():
    model = odd_llama()
    patch_model(model, optimizer="adamw", backend="reference", min_params=0)
    ForgeOptimizer(model, lr=1e-2)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.forge_held is None
    before = layer.weight.detach().clone()
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert not torch.equal(layer.weight, before)


def test_every_rule_is_covered():
    assert set(TORCH_RULES) == set(RULES) - {"lion"}, "a rule without a torch.optim twin needs its own test"


def test_lion_accumulated_equals_one_step_on_the_concatenated_batch():
    model, one = patched_pair("lion", "buffer")
    patch_model(one, optimizer="lion", backend="reference", min_params=0)
    accumulated = ForgeOptimizer(model, lr=1e-4, accumulate=True, max_grad_norm=0.05)
    plain = ForgeOptimizer(one, lr=1e-4, max_grad_norm=0.05)
    micro = batches(K, seed=3)
    for ids in micro:
        (model(input_ids=ids, labels=ids).loss / K).backward()
    accumulated.step()
    whole = torch.cat(micro)
    one(input_ids=whole, labels=whole).loss.backward()
    plain.step()
    assert_models_close(model, one)
    torch.testing.assert_close(accumulated.last_grad_norm, plain.last_grad_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("accumulation", ["stash", "buffer"])
def test_the_triton_backend_holds_and_clips_as_the_reference(accumulation):
    """The same accumulated, clipped steps through the Triton kernels (interpreted on CPU,
    compiled on a GPU): the fused kernel over the stash, the rule pass over the buffer."""
    results = []
    for backend in ("reference", "triton"):
        model = odd_llama().to(DEVICE)
        patch_model(model, optimizer="adamw", backend=backend, min_params=0, accumulation=accumulation)
        optimizer = ForgeOptimizer(model, lr=2e-3, weight_decay=0.01, accumulate=True, max_grad_norm=0.05)
        for ids in batches(2, seed=5):
            ids = ids.to(DEVICE)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        optimizer.step()
        results.append((model, optimizer.last_grad_norm))
    (reference, norm), (triton, triton_norm) = results
    torch.testing.assert_close(triton_norm, norm, rtol=1e-5, atol=0)
    # the kernel's tiles sum the tokens in another order than the reference's GEMM
    assert_models_close(triton, reference, rtol=RTOL_ACCUMULATED["stash"])


@pytest.mark.parametrize("k", [2, 3])
def test_bf16_stash_steps_the_bits_of_one_backward_over_the_same_tokens(k):
    """bf16 weights and bf16 state through the Triton kernel (compiled on a GPU, interpreted on
    CPU): k backwards held in the stash and stepped at step() leave the weight and states with the
    bits one backward over the k micro-batches' rows concatenated leaves, over 2 steps. The fused
    kernel reads the same rows either way, on a 40 x 72 weight (no multiple of a tile)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(72, 40, bias=False).to(torch.bfloat16)
    steps = [[(torch.randn(33, 72, generator=gen), torch.randn(33, 40, generator=gen) / 64) for _ in range(k)]
             for _ in range(2)]
    results = []
    for held in (True, False):
        model = torch.nn.Sequential(copy.deepcopy(base)).to(DEVICE)
        patch_model(model, optimizer="adamw", state_precision="bf16", backend="triton", min_params=0,
                    accumulation="stash")
        optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.01, accumulate=held)
        for pairs in steps:
            pairs = [(x.to(DEVICE, torch.bfloat16), dy.to(DEVICE, torch.bfloat16)) for x, dy in pairs]
            if held:
                for x, dy in pairs:
                    model(x).backward(dy)
                assert model[0].forge_held.tokens == 33 * k
            else:
                model(torch.cat([x for x, _ in pairs])).backward(torch.cat([dy for _, dy in pairs]))
            optimizer.step()
            optimizer.zero_grad()
        layer = model[0]
        results.append([layer.weight.detach(), *(s for s in layer.forge_state.slots if s is not None)])
    held, once = results
    assert not torch.equal(held[0], base.weight.to(DEVICE))  # it moved
    for a, b in zip(held, once):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_bf16_buffer_run_resumes_bit_for_bit():
    """The bf16 buffers' count of backwards travels in the optimizer's state dict: a run stopped
    after a step and resumed from its state dicts rounds its later buffers with the straight
    run's bits (restarting the count would give other ones)."""
    def run(model, optimizer, steps):
        for s in steps:
            for ids in batches(K, seed=10 * s + 1):
                (model(input_ids=ids, labels=ids).loss / K).backward()
            optimizer.step()
            optimizer.zero_grad()

    def built():
        torch.manual_seed(0)
        model = odd_llama().to(torch.bfloat16)
        patch_model(model, optimizer="adamw", backend="reference", min_params=0, accumulation="bf16_buffer")
        return model, ForgeOptimizer(model, lr=2e-3, weight_decay=0.01, accumulate=True)

    straight, straight_opt = built()
    run(straight, straight_opt, range(3))
    first, first_opt = built()
    run(first, first_opt, range(1))
    saved = (first.state_dict(), first_opt.state_dict())
    assert saved[1]["forge_held_adds"] == K  # one count a backward
    resumed, resumed_opt = built()
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    run(resumed, resumed_opt, range(1, 3))
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    restarted, restarted_opt = built()
    restarted.load_state_dict(saved[0])
    restarted_opt.load_state_dict({k: v for k, v in saved[1].items() if k != "forge_held_adds"})
    run(restarted, restarted_opt, range(1, 3))
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), restarted.parameters()))
