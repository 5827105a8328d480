"""4-bit optimizer states (state_precision="log4"): the codec's maps and rounding, both
backends writing the same codes and scales for every rule, shapes that are not multiples of
the tile or the group, skipped non-finite tiles, checkpoints resuming bit for bit, the
memory, and the refusals."""

import pytest
import torch

from forge_hf.core import codecs
from forge_hf.core.codecs import CODECS, GROUP4, QuantisedSlot, decode, encode
from forge_hf.core.config import ForgeConfig
from forge_hf.core.rules import RULES, get_rule
from forge_hf.core.state import ForgeState
from forge_hf.kernels.launch.gluon_launch import weight_layout_unsupported
from forge_hf.kernels.triton.fused_update import fused_launch_arguments
from forge_hf.optim import four_bit_maps
from tests.core.test_state_8bit import _reloaded
from tests.helpers import DEVICE, exact_inputs, stepped_layer

pytestmark = pytest.mark.usefixtures("single_thread")

EXTRA = {"rmsprop": dict(momentum=0.5), "adagrad": dict(initial_accumulator_value=0.1),
         "sgd": dict(momentum=0.9, nesterov=True)}
LR = 1e-2
# the interpreter's float arithmetic is IEEE's, as torch's on CPU: the same codes to the bit;
# a GPU's approximate division and square root in a rule may move a code by one level
EXACT = DEVICE.type == "cpu"


def _trained(backend, rule="adamw", steps=3, shape=(70, 130), conv1d=False, tokens=45, **options):
    options = {"optimizer": rule, "state_precision": "log4", "seed": 11, "backend": backend, "lr": LR,
               **EXTRA.get(rule, {}), **options}
    return stepped_layer(options, steps, conv1d, shape, tokens)


def _assert_slots_agree(a, b, what):
    assert a.codec == b.codec and a.codes.shape == b.codes.shape and a.meta.shape == b.meta.shape, what
    scales_a, scales_b = a.meta.view(torch.int16), b.meta.view(torch.int16)
    if EXACT:
        assert torch.equal(a.codes, b.codes) and torch.equal(scales_a, scales_b), what
    else:
        assert (a.codes == b.codes).float().mean() >= 0.99 and (scales_a == scales_b).float().mean() >= 0.99, what


# --------------------------------------------------------------- the codec


@pytest.mark.parametrize("name,signed,grid", [("slog4", True, "log2"), ("log4", False, "log2")])
def test_codec_is_the_studied_map(name, signed, grid):
    """Rounded to nearest, the codec gives the values of the map the fidelity study chose
    (optim/four_bit_maps.py, docs/architecture.md), odd widths and partial groups included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2 * GROUP4 + 3, generator=gen) * torch.exp2(3 * torch.randn(7, 2 * GROUP4 + 3, generator=gen))
    x = x if signed else x * x
    codes, meta = encode(CODECS[name], x)
    assert codes.shape == (7, GROUP4 + 2) and codes.dtype == torch.uint8
    assert meta.shape == (7, 3, 1) and meta.dtype == torch.bfloat16
    assert torch.equal(decode(CODECS[name], codes, meta, x.shape[1]), four_bit_maps.store(x, grid, signed, GROUP4))


def test_second_moment_codes_have_no_zero():
    """A positive second moment far below its group's largest is never read back as 0 (it
    would make 1/sqrt(v) blow up): it rounds up to the lowest code; a group of zeros stays 0."""
    v = torch.zeros(2, GROUP4)
    v[0, 0], v[0, 1:] = 1.0, 1e-20
    x = decode(CODECS["log4"], *encode(CODECS["log4"], v, torch.zeros_like(v, dtype=torch.int64)))
    assert bool((x[0] > 0).all()) and float(x[0, 1]) == 2.0**-15 and bool((x[1] == 0).all())


@pytest.mark.parametrize("name", ["slog4", "log4"])
def test_stochastic_rounding_is_unbiased(name):
    """Between two grid values a code rounds up with probability equal to the position: the
    mean over many draws is the value (to the draws' spread)."""
    x = torch.tensor([[1.0, 0.75, 0.3, 0.05, 0.011] + [0.0] * (GROUP4 - 5)])
    x = x if name == "log4" else -x
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([decode(CODECS[name], *encode(CODECS[name], x, torch.randint(0, 2**16, x.shape,
                                                                                     generator=gen)))
                         for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0)[:, :5], x[:, :5], rtol=0.03, atol=0)


# --------------------------------------------------------------- both backends


@pytest.mark.parametrize("shape", [(70, 130), (33, 71)], ids=["70x130", "33x71"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_triton_matches_reference(rule, shape):
    """Every rule, shapes that are not multiples of the 64x64 tile or the 64-element group
    (71: an odd width, the row's last byte half used), three steps: the same codes and scales."""
    ref = _trained("reference", rule, shape=shape)
    tri = _trained("triton", rule, shape=shape)
    for i, (a, b) in enumerate(zip(ref.forge_state.slots, tri.forge_state.slots)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.codec.bits == 4 and a.codes.shape == (shape[0], (shape[1] + 1) // 2)
            _assert_slots_agree(a, b, f"{rule} slot {i}")
    # the rules' fp32 arithmetic agrees to round-off, as for fp32 states (test_backends.py)
    scale = ref.weight.detach().abs().max()
    assert float((tri.weight.detach() - ref.weight.detach()).abs().max() / scale) <= 1e-5


def test_conv1d_state_is_the_linear_layers():
    """A Conv1D's (in, out) weight keeps 4-bit codes in logical (out, in / 2) layout: the same
    codes as the same layer as a Linear, on both backends."""
    ref = _trained("reference", conv1d=True)
    tri = _trained("triton", conv1d=True)
    lin = _trained("reference")
    assert ref.weight.shape == (130, 70)
    for a, b, c in zip(ref.forge_state.kernel_slots()[:2], tri.forge_state.kernel_slots()[:2],
                       lin.forge_state.kernel_slots()[:2]):
        assert a.codes.shape == (70, 65) and a.meta.shape == (70, 3, 1)
        _assert_slots_agree(a, b, "conv1d")
        assert torch.equal(a.codes, c.codes) and torch.equal(a.meta, c.meta)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the skipped tile
def test_nonfinite_tile_leaves_codes_and_scales_untouched(backend):
    layer = _trained(backend, shape=(80, 100), steps=1)
    before = [(s.codes.clone(), s.meta.clone()) for s in layer.forge_state.slots[:2]]
    x, dy = torch.randn(10, 100, device=DEVICE), torch.randn(10, 80, device=DEVICE)
    dy[3, 5] = float("nan")  # rows 0..63 (tile row 0) are poisoned
    layer(x).backward(dy)
    assert layer.forge_stats[1].item() == 2  # two tiles of row 0 skipped
    for (codes, meta), s in zip(before, layer.forge_state.slots[:2]):
        assert torch.equal(s.codes[:64], codes[:64]) and torch.equal(s.meta[:64], meta[:64])
        assert not torch.equal(s.codes[64:], codes[64:])  # the finite tiles stepped


@pytest.mark.parametrize("resume_backend", ["reference", "triton"])
def test_checkpoint_resumes_bit_for_bit(resume_backend):
    """Codes and scales saved and loaded exactly; the resumed layer's next steps equal the
    uninterrupted one's."""
    a = _trained(resume_backend, steps=2, shape=(33, 71))
    sd = _reloaded(a.forge_state.state_dict())
    assert sd["precision"] == "log4" and (sd["exp_avg_codec"], sd["exp_avg_sq_codec"]) == ("slog4", "log4")
    b = _trained(resume_backend, steps=0, shape=(33, 71))
    b.weight.data.copy_(a.weight.data)
    b.forge_state.load_state_dict(sd, b.weight)
    gen = torch.Generator().manual_seed(9)
    batches = [exact_inputs((20, 71), 33, generator=gen, device=DEVICE) for _ in range(2)]
    for layer in (a, b):
        for x, dy in batches:
            layer(x).backward(dy)
    assert torch.equal(a.weight, b.weight)
    for sa, sb in zip(a.forge_state.slots[:2], b.forge_state.slots[:2]):
        assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.meta, sb.meta)


def test_loading_another_precision_converts():
    """An fp32 checkpoint into log4 and back: values within the 4-bit grid's rounding."""
    a = _trained("reference", steps=2, shape=(33, 71), state_precision="fp32")
    b = _trained("reference", steps=0, shape=(33, 71))
    with pytest.warns(UserWarning, match="saved as fp32 is converted to log4"):
        b.forge_state.load_state_dict(_reloaded(a.forge_state.state_dict()), b.weight)
    m = b.forge_state.slots[0].read()
    assert m.shape == (33, 71) and float((m - a.forge_state.slots[0]).abs().max()) <= \
        float(a.forge_state.slots[0].abs().max())
    c = _trained("reference", steps=0, shape=(33, 71), state_precision="fp32")
    with pytest.warns(UserWarning, match="saved as log4 is converted to fp32"):
        c.forge_state.load_state_dict(_reloaded(b.forge_state.state_dict()), c.weight)
    assert torch.equal(c.forge_state.slots[0], m)


def test_state_memory_is_half_a_byte_per_parameter_plus_group_scales():
    """AdamW: two 4-bit codes a byte and a bf16 scale per 64 elements for each moment."""
    layer = _trained("reference", steps=1, shape=(96, 256))
    per_param = 2 * (0.5 + 2 / GROUP4)
    assert layer.forge_state.nbytes() == per_param * layer.weight.numel() == 1.0625 * layer.weight.numel()


# --------------------------------------------------------------- refusals


def test_centered_rmsprop_is_refused():
    with pytest.raises(ValueError, match=r"state_precision='log4' cannot serve rmsprop with centered=True .*: "
                                         r"use centered=False, or state_precision='int8' or 'bf16'"):
        ForgeConfig(optimizer="rmsprop", state_precision="log4", hyperparameters={"centered": True})


def test_a_tensor_that_is_not_2d_is_refused():
    state = ForgeState(get_rule("adamw"), "log4", transposed=False)
    with pytest.raises(ValueError, match=r"state_precision='log4' quantises a fused layer's 2-d weight along its "
                                         r"rows, not a \(70,\) tensor: give it ForgeState\(\.\.\., transposed=None\)"):
        state.allocate(torch.zeros(70), dict(get_rule("adamw").defaults))
    bias = ForgeState(get_rule("adamw"), "log4", transposed=None)  # a tensor the optimizer steps: bf16 states
    bias.allocate(torch.zeros(70), dict(get_rule("adamw").defaults))
    assert bias.stored_precision == "bf16" and bias.slots[0].dtype == torch.bfloat16


def test_launcher_refuses_4bit_beside_other_slots():
    w = torch.zeros(64, 64)
    four = QuantisedSlot.empty_like(w, CODECS["slog4"], False)
    with pytest.raises(ValueError, match="4-bit state slots share a layer's kernel only with other 4-bit slots"):
        fused_launch_arguments(w, w, w, [four, torch.zeros(64, 64), None], torch.zeros(16, dtype=torch.int32),
                               torch.zeros(2), "adamw", False)
    with pytest.raises(ValueError, match=r"4-bit codes of shape \(64, 64\) do not fit a \(64, 64\) weight"):
        bad = QuantisedSlot(CODECS["slog4"], torch.zeros(64, 64, dtype=torch.uint8), four.meta)
        fused_launch_arguments(w, w, w, [bad, None, None], torch.zeros(16, dtype=torch.int32), torch.zeros(2),
                               "sgd", False)


def test_gluon_kernels_are_never_chosen_for_4bit_states():
    """The Gluon kernels do not serve 4-bit codes yet: a layer with them goes to the Triton kernel."""
    w = torch.zeros(128, 128, dtype=torch.bfloat16)
    slots = [QuantisedSlot.empty_like(w, CODECS[n], False) for n in ("slog4", "log4")] + [None]
    reason = weight_layout_unsupported(w, slots, codecs.storage_kinds(slots), 128)
    assert reason is not None and "4-bit" in reason
