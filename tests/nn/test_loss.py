"""The chunked cross-entropy against float64 and against Hugging Face's loss: several
blocks of rows with a partial last one, ignored targets, bf16 and fp32 logits."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from forge_hf.nn import loss as loss_module
from forge_hf.nn.loss import ChunkedCrossEntropy, causal_lm_loss, cross_entropy, shifted_cross_entropy
from tests.helpers import DEVICE, bf16_ulps_apart

N, V = 10, 37


def _logits_targets(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[[2, 7]] = -100
    return logits, targets


def _chunked(logits, targets, chunk_rows=3):
    x = logits.clone().requires_grad_()
    loss = ChunkedCrossEntropy.apply(x, targets, -100, chunk_rows)
    loss.backward()
    return loss, x.grad


def test_fp32_logits_agree_with_float64_over_several_blocks():
    logits, targets = _logits_targets(torch.float32)
    loss, grad = _chunked(logits, targets)
    ref = logits.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, targets, ignore_index=-100)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert (grad.double() - ref.grad).abs().max() <= 1e-7  # entries are below 1/8 here
    assert torch.all(grad[[2, 7]] == 0)


def test_bf16_logits_get_huggingfaces_gradient_to_one_ulp():
    logits, targets = _logits_targets(torch.bfloat16, seed=1)
    loss, grad = _chunked(logits, targets)
    hf = logits.clone().requires_grad_()
    hf_loss = F.cross_entropy(hf.float(), targets, ignore_index=-100)
    hf_loss.backward()
    assert grad.dtype == torch.bfloat16
    assert abs(loss.item() - hf_loss.item()) <= 1e-6 * abs(hf_loss.item())
    assert bf16_ulps_apart(grad, hf.grad).max() <= 1


def test_a_batch_without_targets_gives_zero_not_nan():
    logits, _ = _logits_targets(torch.float32)
    loss, grad = _chunked(logits, torch.full((N,), -100))
    assert loss.item() == 0.0 and torch.all(grad == 0)


def test_cross_entropy_checks_shapes_and_skips_the_trick_without_grad():
    logits, targets = _logits_targets(torch.float32)
    with pytest.raises(ValueError, match=r"logits of shape \(1, 10, 37\).*\(tokens, vocabulary\)"):
        cross_entropy(logits[None], targets)
    with torch.no_grad():
        assert torch.equal(cross_entropy(logits, targets), F.cross_entropy(logits, targets))


def test_causal_lm_loss_is_huggingfaces_loss():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    ours = causal_lm_loss(model, dict(input_ids=ids, labels=labels))
    ours.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    theirs = model(input_ids=ids, labels=labels).loss
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()
    for g, p in zip(grads, model.parameters()):
        assert (g - p.grad).abs().max() <= 1e-5 * p.grad.abs().max()
    with pytest.raises(ValueError, match="no 'labels'"):
        causal_lm_loss(model, dict(input_ids=ids))


def test_causal_lm_loss_builds_no_key_value_cache():
    """A training forward has no use for transformers' cache (use_cache defaults to on);
    the caller may still ask for one."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    assert model.config.use_cache
    caches = []
    forward = model.forward
    model.forward = lambda **kw: caches.append(forward(**kw).past_key_values) or forward(**kw)
    ids = torch.randint(0, 64, (1, 9))
    causal_lm_loss(model, dict(input_ids=ids, labels=ids))
    causal_lm_loss(model, dict(input_ids=ids, labels=ids, use_cache=True))
    assert caches[0] is None and caches[1] is not None


def test_under_capture_the_cache_stays_so_sdpa_gets_no_mask(monkeypatch):
    """Without a cache, transformers cannot check position_ids for packed sequences while a
    CUDA graph is captured and builds a 4-D mask (SDPA's masked path keeps expanded keys and
    values for backward); with its cache it passes none. Capture is emulated on CPU."""
    import transformers.integrations.sdpa_attention as sdpa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from forge_hf.nn import loss
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    masks = []
    attention = sdpa.sdpa_attention_forward
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa",
                        lambda module, q, k, v, mask, *a, **kw: masks.append(mask) or attention(module, q, k, v, mask,
                                                                                                  *a, **kw))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # as transformers sees it
    monkeypatch.setattr(loss, "_capturing", lambda: True)
    ids = torch.randint(0, 64, (1, 9))
    causal_lm_loss(model, dict(input_ids=ids, labels=ids))
    model(input_ids=ids, use_cache=False)  # what passing use_cache=False would do
    assert masks[0] is None and masks[1] is not None


def test_a_second_backward_is_refused_not_computed_from_overwritten_logits():
    logits, targets = _logits_targets(torch.float32)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match="backward ran twice.*retain_graph"):
        loss.backward()
    assert torch.equal(x.grad, first)  # nothing added


class _LiveBlocks(TorchDispatchMode):
    """The most fp32 tensors of one block's shape alive at once while the mode is on."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.alive, self.most = tuple(shape), {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == self.shape:
                key = id(t)
                self.alive[key] = weakref.ref(t, lambda _, key=key: self.alive.pop(key, None))
        self.most = max(self.most, len(self.alive))
        return out


def test_forward_and_backward_keep_one_fp32_block_of_rows_alive():
    """A block of rows at a time, each dropped before the next is made, the gradient formed
    in place: a Llama-3 step's peak falls in this loss, with every activation still saved
    (three blocks alive in backward cost 0.12 GiB there)."""
    logits, targets = _logits_targets(torch.bfloat16)
    x = logits.clone().requires_grad_()
    with _LiveBlocks((4, V)) as forward:
        loss = ChunkedCrossEntropy.apply(x, targets, -100, 4)
    with _LiveBlocks((4, V)) as backward:
        loss.backward()
    assert forward.most == 1 and backward.most == 1
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref.float(), targets, ignore_index=-100).backward()
    assert bf16_ulps_apart(x.grad, ref.grad).max() <= 1


# ------------------------------------------- Hugging Face's ForCausalLMLoss, num_items_in_batch

B, T = 2, 9  # 18 positions, 12 of them with a target after the shift


def _causal_logits_labels(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    return logits, labels


# the Trainer's divisors: none (the mean), an int, its count as a long tensor, and that count
# divided by a parallel size (a float tensor); 30 is not the batch's own 12, as when the count
# covers accumulated micro-batches or other ranks
NUM_ITEMS = {"none": None, "int": 30, "long_tensor": torch.tensor(30), "float_tensor": torch.tensor(30.0)}


def _both(logits, labels, num_items):
    ours = logits.clone().requires_grad_()
    loss = shifted_cross_entropy(ours, labels, num_items_in_batch=num_items)
    loss.backward()
    theirs = logits.clone().requires_grad_()
    hf_loss = ForCausalLMLoss(theirs, labels, vocab_size=V, num_items_in_batch=num_items)
    hf_loss.backward()
    return loss, ours.grad, hf_loss, theirs.grad


@pytest.mark.parametrize("num_items", NUM_ITEMS.values(), ids=NUM_ITEMS.keys())
def test_shifted_cross_entropy_is_for_causal_lm_loss_fp32(num_items, monkeypatch):
    """fp32 logits, blocks of 4 rows (a partial last one): the loss within 1e-6 (relative)
    and the logits' gradient within 1e-6 of its largest entry (fp32 summation order)."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 4 * V)
    loss, grad, hf_loss, hf_grad = _both(*_causal_logits_labels(torch.float32), num_items)
    assert loss.dtype == hf_loss.dtype == torch.float32
    assert abs(loss.item() - hf_loss.item()) <= 1e-6 * abs(hf_loss.item())
    assert (grad - hf_grad).abs().max() <= 1e-6 * hf_grad.abs().max()
    assert torch.all(grad[:, -1] == 0) and torch.all(grad[0, :2] == 0)  # no target there
    if num_items is not None:  # the sum over the 12 targets divided by 30, not their mean
        mean = ForCausalLMLoss(*_causal_logits_labels(torch.float32), vocab_size=V)
        assert loss.item() == pytest.approx(mean.item() * 12 / 30, rel=1e-6)


@pytest.mark.parametrize("num_items", NUM_ITEMS.values(), ids=NUM_ITEMS.keys())
def test_shifted_cross_entropy_is_for_causal_lm_loss_bf16(num_items, monkeypatch):
    """bf16 logits: the loss within 1e-6 (relative), the gradient (bf16) within one bf16 step."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 4 * V)
    loss, grad, hf_loss, hf_grad = _both(*_causal_logits_labels(torch.bfloat16, seed=1), num_items)
    assert grad.dtype == torch.bfloat16
    assert abs(loss.item() - hf_loss.item()) <= 1e-6 * abs(hf_loss.item())
    assert bf16_ulps_apart(grad, hf_grad).max() <= 1


@pytest.mark.parametrize("num_items", NUM_ITEMS.values(), ids=NUM_ITEMS.keys())
def test_without_grad_the_loss_is_for_causal_lm_loss_bit_for_bit(num_items):
    """Evaluation takes torch's cross-entropy on the fp32 logits, as Hugging Face does."""
    logits, labels = _causal_logits_labels(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(shifted_cross_entropy(logits, labels, num_items),
                           ForCausalLMLoss(logits, labels, vocab_size=V, num_items_in_batch=num_items))


# ------------------------------------------------- the fused row kernels (TRITON_INTERPRET on CPU)
# A row's log-sum-exp is summed lane by lane in blocks here, by torch in its own order: fp32
# sums that agree to 1e-6 relative. The gradient's exponent x - lse carries that rounding
# (1e-6 of |lse|, about 10 here): fp32 gradients agree to 1e-5 relative, bf16 ones to one
# bf16 step.


def _wide_logits(dtype, rows=5, vocab=9000, seed=1):
    """Two full blocks of the kernels and a partial third; a row of -inf but for one logit. On
    the GPU where there is one (the row kernels' device), else for Triton's interpreter."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[3] = float("-inf")
    logits[3, 8999] = 2.0
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3] = 8999
    return logits.to(DEVICE), targets.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_kernels_give_torchs_lse_target_logit_and_gradient(dtype):
    from forge_hf.kernels.triton.cross_entropy import row_grad_, row_lse

    logits, targets = _wide_logits(dtype)
    lse, picked = row_lse(logits, targets)
    ref = logits.float()
    torch.testing.assert_close(lse, torch.logsumexp(ref, dim=-1), rtol=1e-6, atol=0)
    assert torch.equal(picked, ref.gather(1, targets[:, None]).squeeze(1))
    scale = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.25], device=DEVICE)
    grad = logits.clone()
    row_grad_(grad, targets, lse, scale)
    expected = (torch.softmax(ref, dim=-1) - F.one_hot(targets, ref.shape[1])) * scale[:, None]
    if dtype == torch.bfloat16:
        assert bf16_ulps_apart(grad, expected.to(dtype)).max() <= 1
    else:
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-9)
    assert not grad[1].any()  # a row whose scale is 0 (its target ignored)


def test_on_the_row_kernels_the_loss_is_the_chunked_loss(monkeypatch):
    logits, targets = _wide_logits(torch.bfloat16)
    targets[1] = -100
    results = []
    for kernels in (False, True):
        monkeypatch.setattr(loss_module, "_on_row_kernels", lambda logits, kernels=kernels: kernels)
        results.append(_chunked(logits, targets, chunk_rows=2))
    (loss, grad), (fused_loss, fused_grad) = results
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    assert bf16_ulps_apart(fused_grad, grad).max() <= 1 and not fused_grad[1].any()


def test_row_kernels_refuse_logits_whose_rows_are_not_contiguous():
    from forge_hf.kernels.triton.cross_entropy import row_lse

    logits, targets = _wide_logits(torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        row_lse(logits.t().contiguous().t(), targets)
