"""ForgeOptimizer's small 1-d tensors (norms, biases) stepped in one launch
(kernels/triton/multi_tensor.py): the same bits as one launch a tensor, tile by tile the same
non-finite skips, one launch a step, and what was queued stepped even when a later tensor's
step fails."""

import pytest
import torch
from torch import nn

from forge_hf import ForgeLinear
from forge_hf.kernels.triton import multi_tensor
from forge_hf.optim.optimizer import ForgeOptimizer
from tests.helpers import DEVICE

# 1, 63: shorter than a tile; 100: a partial second tile; 1500: a program and a partial one;
# 2048: two whole programs (16 tiles of 64 each)
LENGTHS = (1, 63, 100, 1500, 2048)


class Vectors(nn.Module):
    """A fused layer (ForgeOptimizer needs one) and 1-d parameters of awkward lengths."""

    def __init__(self, dtype, rule, precision, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = ForgeLinear(16, 8, bias=False, optimizer=rule, state_precision=precision, backend="triton",
                                dtype=dtype, device=DEVICE)
        self.vectors = nn.ParameterList(nn.Parameter(torch.randn(n, dtype=dtype, device=DEVICE)) for n in LENGTHS)

    def set_grads(self, step):
        gen = torch.Generator().manual_seed(100 + step)
        for v in self.vectors:
            v.grad = (torch.randn(v.shape, generator=gen) * 1e-2).to(DEVICE, v.dtype)


def run(batched: bool, dtype, rule="adamw", precision="bf16", steps=3, poison=None):
    """Weights, states, skipped tiles and grad norms after ``steps`` steps, and the number of
    vectors in each multi-tensor launch; ``poison``: (vector, element) made NaN at step 1."""
    model = Vectors(dtype, rule, precision)
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    if not batched:
        optimizer._add_to_batch = lambda *a: False
    launches = []
    launch = multi_tensor.MultiTensorRulePass.launch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multi_tensor.MultiTensorRulePass, "launch",
                      lambda self, stats: (launches.append(len(self._rows)), launch(self, stats)))
        tiles, norms = [], []
        for step in range(steps):
            model.set_grads(step)
            if poison is not None and step == 1:
                model.vectors[poison[0]].grad[poison[1]] = float("nan")
            optimizer.step()
            tiles.append(optimizer.pop_nonfinite_tiles())
            norms.append(optimizer.last_grad_norm.item())
    states = [[s.clone() for s in optimizer.state[v].slots if s is not None] for v in model.vectors]
    return [v.detach().clone() for v in model.vectors], states, tiles, norms, launches


@pytest.mark.parametrize("dtype,rule,precision", [(torch.bfloat16, "adamw", "bf16"),
                                                  (torch.bfloat16, "lion", "int8"),
                                                  (torch.float32, "nadam", "fp32")])
def test_one_launch_steps_every_vector_as_one_launch_each_does(dtype, rule, precision):
    """Bit for bit over three steps, the states' first step (new argument rows) included."""
    one_each = run(False, dtype, rule, precision)
    batched = run(True, dtype, rule, precision)
    assert one_each[4] == [] and batched[4] == [len(LENGTHS)] * 3  # one launch a step, every vector in it
    for a, b in zip(one_each[0], batched[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(one_each[1], batched[1]):
        assert len(sa) == len(sb) > 0
        for a, b in zip(sa, sb):
            assert torch.equal(a, b)
    assert batched[3] == pytest.approx(one_each[3], rel=1e-6)  # the grad norm: the same sums, another order


def test_a_non_finite_tile_is_skipped_and_counted_alone():
    """A NaN at element 70 of the 1500-long vector: its tile (64-127) is not written, the
    rest of the vector is, and the count is one tile, as with a launch of its own."""
    one_each = run(False, torch.bfloat16, poison=(3, 70))
    batched = run(True, torch.bfloat16, poison=(3, 70))
    assert batched[2] == one_each[2] == [0, 1, 0]
    for a, b in zip(one_each[0], batched[0]):
        assert torch.equal(a, b)


def test_tensors_outside_a_batch_keep_a_launch_of_their_own():
    weight = torch.zeros(8, 4)
    grad = torch.zeros(8, 4)
    assert multi_tensor.batch_kind(weight, grad, [None] * 3) is None  # 2-d
    assert multi_tensor.batch_kind(torch.zeros(10)[::2], torch.zeros(5), [None] * 3) is None  # strided
    big = torch.zeros(multi_tensor.MAX_ELEMENTS + 1)
    assert multi_tensor.batch_kind(big, big, [None] * 3) is None
    half = torch.zeros(4, dtype=torch.float16)
    assert multi_tensor.batch_kind(half, half, [None] * 3) is None
    assert multi_tensor.batch_kind(torch.zeros(4), torch.zeros(4), [torch.zeros(4), None, None]) is not None


def test_what_was_queued_is_stepped_when_a_later_tensor_fails():
    """A bad hyperparameter in the second group raises at its first tensor; the first
    group's vectors, queued before it, are stepped as they were when each had its launch."""
    model = Vectors(torch.bfloat16, "adamw", "bf16")
    optimizer = ForgeOptimizer(model, lr=1e-2, decay_parameter_names=["vectors.0", "vectors.1"])
    model.set_grads(0)
    before = [v.detach().clone() for v in model.vectors]
    optimizer.param_groups[1]["betas"] = (0.3, 0.999)  # 1 - beta1 = 0.7: refused
    with pytest.raises(ValueError, match="0.7 is not below 0.5"):
        optimizer.step()
    moved = [not torch.equal(b, v) for b, v in zip(before, model.vectors)]
    assert moved == [True, True, False, False, False]
    assert [optimizer.state[v].step for v in model.vectors] == [1, 1, 0, 0, 0]


def test_a_first_launch_inside_a_capture_is_refused_clearly(monkeypatch):
    """Its table, work list and kernel are made at an eager launch: a capture that comes first
    is refused with the fix, before anything is launched."""
    from forge_hf.core import codecs

    kind = (torch.device("cpu"), codecs.BF16, True, (codecs.BF16, codecs.BF16, codecs.NONE))
    batch = multi_tensor.MultiTensorRulePass(kind, "adamw", True)
    batch._cuda = True  # as on a GPU, whose capture is stood in for
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    w = torch.zeros(10, dtype=torch.bfloat16)
    batch.add(w, w, [w, w, None], torch.zeros(16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="1 small tensors' rule steps is first needed while a CUDA graph is "
                                           "captured.*run an eager step.*warmup_steps"):
        batch.launch(torch.zeros(2))
