"""A program that owns several tiles (``subtiles``: they share the token loop's x and dy
loads) gives exactly what one program per tile gives: same weights and states, bit for
bit, over several steps, on shapes whose edges cut through a program's tiles and leave
some tiles wholly outside the weight."""

import pytest
import torch

from forge_hf.kernels.fused_update import launch_fused_update
from forge_hf.rules import get_rule, make_group
from forge_hf.state import ForgeState
from forge_hf.step_args import pack_args
from conftest import DEVICE
from helpers import exact_inputs

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCKS = (32, 64, 16)


def _stepped(precision, shape, subtiles, steps=3):
    rule = get_rule("adamw")
    group = make_group(rule, dict(lr=1e-2, weight_decay=0.1))
    n, k = shape
    w_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    w = (torch.linspace(-1, 1, n * k, device=DEVICE).view(n, k) * 0.3).to(w_dtype)
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, group)
    stats = torch.zeros(2, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        # exact inputs: the gradient does not depend on how the token loop is split
        x, dy = exact_inputs((40, k), n, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        args = pack_args(rule.prepare(group, state.host), state.step, 9, DEVICE)
        launch_fused_update(x, dy, w, state.kernel_slots(), args, stats, "adamw", True,
                            blocks=BLOCKS, subtiles=subtiles)
    return w, state.kernel_slots(), stats


def _tensors(slot):
    return [] if slot is None else ([slot.codes, slot.meta] if hasattr(slot, "codes") else [slot])


@pytest.mark.parametrize("shape", [(70, 200), (128, 256)], ids=["ragged", "even"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "al8"])
def test_subtiles_give_the_one_tile_programs_bits(precision, shape):
    w0, slots0, stats0 = _stepped(precision, shape, (1, 1))
    assert torch.count_nonzero(stats0[0]) == 1 and stats0[1] == 0
    for subtiles in ((1, 2), (2, 1), (2, 2)):
        w, slots, stats = _stepped(precision, shape, subtiles)
        assert torch.equal(w, w0), f"{precision} weight, subtiles {subtiles}"
        for i, (a, b) in enumerate(zip(slots0, slots)):
            for ta, tb in zip(_tensors(a), _tensors(b)):
                assert torch.equal(ta, tb), f"{precision} state {i}, subtiles {subtiles}"
        # the squared-gradient sum is added tile by tile in another order
        torch.testing.assert_close(stats, stats0, rtol=1e-6, atol=0)


def test_launcher_refuses_subtiles_other_than_one_or_two():
    w = torch.zeros(8, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"subtiles=\(3, 1\): a program owns 1 or 2 tiles along each axis"):
        launch_fused_update(torch.zeros(4, 64, device=DEVICE), torch.zeros(4, 8, device=DEVICE), w,
                            [None, None, None], torch.zeros(15, dtype=torch.int32, device=DEVICE),
                            torch.zeros(2, device=DEVICE), "sgd", False, subtiles=(3, 1))
    assert torch.all(w == 0)
