"""The fused step on QuACK's Hopper GEMM (kernels/cute/wgrad_epilogue.py) against the Triton
fused kernel (kernels/triton/fused_update.py) on a Hopper GPU: every rule, fp32, bf16, int8 and
al8 states, stochastic and nearest rounding, bf16 and fp32 weights, three steps each, on a shape
that is no multiple of the 128 x 128 tile (nor of the Triton kernel's 64 x 64 blocks, nor of the
8-bit codes' 64-column blocks) and on one that is.
Both form each gradient entry from the same 64-token wgmma chunks in the same order and run
the same rule code on the same fp32 operations, so weights and states are compared bit for bit.

  python -m pytest -q tests/kernels/test_cute_gpu.py          (-n 4: pytest-xdist spreads the compiles)

The time is compilation on a cold cache (39 epilogues, ~1.3 s each on a CPU, and 42 Triton variants); QuACK's
and Triton's disk caches keep them for the next run."""

import pytest
import torch

from forge_hf.core.codecs import QuantisedSlot
from forge_hf.core.launch_args import pack_args
from forge_hf.core.rules import get_rule, make_group
from forge_hf.core.state import ForgeState
from forge_hf.kernels import cute
from tests.helpers import quack_on_hopper

BF16, FP32 = torch.bfloat16, torch.float32
RAGGED = (1000, 1496, 777)  # out, in, tokens
RAGGED_8BIT = (1000, 1504, 777)  # in features a multiple of 16 (TMA rows of codes), the last codec block half full
TILED = (512, 768, 256)
SALT = 77


pytestmark = quack_on_hopper()

# Hyperparameters under which each rule keeps all its slots; RAdam's steps 4-6 cross its
# rectification threshold (rho_t > 5 from step 6), so both sides of its ops.where are taken
RULES = [("adamw", dict(weight_decay=0.1), 0), ("nadam", dict(weight_decay=0.01), 0), ("radam", {}, 3),
         ("lion", dict(weight_decay=0.1), 0), ("rmsprop", dict(momentum=0.9, centered=True), 0),
         ("adagrad", dict(initial_accumulator_value=0.1), 0), ("sgd", dict(momentum=0.9, nesterov=True), 0)]
# ... and some that leave slots empty: none, the second or the third
EMPTY_SLOTS = [("sgd", {}, 0), ("rmsprop", dict(centered=True), 0), ("rmsprop", dict(momentum=0.5), 0)]


def _layer(shape, rule_name, hp, precision, weight_dtype, steps_before):
    n, k, t = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=g).to(BF16)
    dy = (torch.randn(t, n, device="cuda", generator=g) * 1e-2).to(BF16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(weight_dtype)
    rule = get_rule(rule_name)
    group = make_group(rule, hp)
    state = ForgeState(rule, precision, transposed=False)
    state.allocate(w, group)
    for _ in range(steps_before):
        rule.prepare(group, state.host)
    return x, dy, w, state, rule, group


def _steps(engine, shape, rule_name, hp, precision, weight_dtype, stochastic, steps_before, steps=3):
    """{name: tensor} of the weight and the present states after ``steps`` steps of ``engine``
    ("cute" or "triton")."""
    from forge_hf.kernels.dispatch import launch_fused_update
    from forge_hf.kernels.triton.fused_update import default_config

    W = cute.load()
    x, dy, w, state, rule, group = _layer(shape, rule_name, hp, precision, weight_dtype, steps_before)
    slots = state.kernel_slots()
    stats = torch.zeros(2, device="cuda")
    for _ in range(steps):
        args = pack_args(rule.prepare(group, state.host), state.host["step"], SALT, "cuda")
        if engine == "cute":
            W.fused_step(x, dy, w, slots, args, rule=rule_name, stochastic=stochastic)
        else:
            blocks = default_config(*w.shape, x.shape[0])["blocks"]
            launch_fused_update(x, dy, w, slots, args, stats, rule_name, stochastic, blocks=blocks)
    torch.cuda.synchronize()
    return {"weight": w, **stored_tensors(rule.slot_names, slots)}


def stored_tensors(names, slots) -> dict:
    """Each present slot's stored tensors by name: an 8-bit slot's codes and metadata."""
    stored = {}
    for name, slot in zip(names, slots):
        if isinstance(slot, QuantisedSlot):
            stored.update({name: slot.codes, f"{name}_meta": slot.meta})
        elif slot is not None:
            stored[name] = slot
    return stored


def assert_same_bits(shape, rule_name, hp, precision, weight_dtype, stochastic, steps_before):
    got, want = (_steps(engine, shape, rule_name, hp, precision, weight_dtype, stochastic, steps_before)
                 for engine in ("cute", "triton"))
    w0 = _layer(shape, rule_name, hp, precision, weight_dtype, steps_before)[2]
    assert not torch.equal(want["weight"], w0), "the steps left the weight as it was: nothing would be compared"
    assert got.keys() == want.keys()
    for name in want:
        bytes_ = (t.contiguous().view(torch.uint8) for t in (got[name], want[name]))
        differ = torch.ne(*bytes_).sum().item()
        assert differ == 0, f"{name}: {differ} bytes of {got[name].nbytes} differ from the Triton kernel's"


@pytest.mark.parametrize("stochastic", [True, False], ids=["sr", "rn"])
@pytest.mark.parametrize("precision", ["bf16", "fp32", "int8", "al8"])
@pytest.mark.parametrize("rule_name,hp,steps_before", RULES, ids=[r[0] for r in RULES])
def test_every_rule_and_state_precision_gives_the_triton_kernels_bits(rule_name, hp, steps_before, precision,
                                                                      stochastic):
    """8-bit states' codes and block metadata too: absmax8 and al8 on the signed and
    never-negative slots."""
    shape = RAGGED_8BIT if precision in ("int8", "al8") else RAGGED
    assert_same_bits(shape, rule_name, hp, precision, BF16, stochastic, steps_before)


@pytest.mark.parametrize("precision", ["int8", "al8"])
def test_8bit_states_with_empty_slots_and_an_fp32_weight(precision):
    assert_same_bits(RAGGED_8BIT, "rmsprop", dict(centered=True), precision, BF16, True, 0)
    assert_same_bits(RAGGED_8BIT, "adamw", dict(weight_decay=0.1), precision, FP32, True, 0)


@pytest.mark.parametrize("rule_name,hp,steps_before", RULES, ids=[r[0] for r in RULES])
def test_fp32_weights_with_fp32_states(rule_name, hp, steps_before):
    assert_same_bits(RAGGED, rule_name, hp, "fp32", FP32, True, steps_before)


def test_an_fp32_weight_with_bf16_states():
    assert_same_bits(RAGGED, "adamw", dict(weight_decay=0.1), "bf16", FP32, True, 0)


@pytest.mark.parametrize("rule_name,hp,steps_before", EMPTY_SLOTS, ids=["sgd", "rmsprop_centered", "rmsprop_momentum"])
def test_rules_with_empty_slots(rule_name, hp, steps_before):
    assert_same_bits(RAGGED, rule_name, hp, "bf16", BF16, True, steps_before)


@pytest.mark.parametrize("rule_name,hp,precision,weight_dtype", [
    ("adamw", dict(weight_decay=0.1), "bf16", BF16), ("rmsprop", dict(momentum=0.9, centered=True), "bf16", BF16),
    ("lion", dict(weight_decay=0.1), "fp32", FP32)], ids=["adamw", "rmsprop", "lion_fp32"])
def test_a_shape_of_whole_tiles(rule_name, hp, precision, weight_dtype):
    assert_same_bits(TILED, rule_name, hp, precision, weight_dtype, True, 0)


def test_the_engine_replays_in_a_cuda_graph_as_it_runs_eagerly():
    """A step captured once and replayed with each step's argument row gives the eager steps'
    bits and statistics: the engine launches on torch's current stream and reads its scalars
    from the row at run time (launch/quack_launch.py runs it inside the Trainer's graphs)."""
    W = cute.load()
    runs = []
    for captured in (False, True):
        x, dy, w, state, rule, group = _layer(RAGGED, "adamw", dict(weight_decay=0.1), "bf16", BF16, 0)
        slots, stats = state.kernel_slots(), torch.zeros(2, device="cuda")
        args = pack_args(rule.prepare(group, state.host), state.host["step"], SALT, "cuda")
        W.fused_step(x, dy, w, slots, args, stochastic=True, stats=stats)  # eager: compiles
        graph = torch.cuda.CUDAGraph()
        if captured:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                W.fused_step(x, dy, w, slots, args, stochastic=True, stats=stats)
            torch.cuda.current_stream().wait_stream(side)
        for _ in range(2):
            args.copy_(pack_args(rule.prepare(group, state.host), state.host["step"], SALT, "cuda"))
            if captured:
                graph.replay()
            else:
                W.fused_step(x, dy, w, slots, args, stochastic=True, stats=stats)
        torch.cuda.synchronize()
        runs.append([w, *[s for s in slots if s is not None], stats])
    eager, replayed = runs
    for a, b in zip(eager[:-1], replayed[:-1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(replayed[-1], eager[-1], rtol=1e-5, atol=0)
