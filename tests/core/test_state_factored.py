"""A factored second moment (state_precision="log4_factored"): both backends (m codes to the
bit, the vectors to fp32 round-off), the vectors as the EMA of the squared gradient's row and
column sums, AdamW's first step, skipped tiles, checkpoints resuming bit for bit, the memory,
and the refusals."""

import pytest
import torch

from forge_hf.core import codecs
from forge_hf.core.config import ForgeConfig
from forge_hf.core.factored import FactoredSlot, refuse_sharded
from forge_hf.core.rules import get_rule
from forge_hf.core.state import ForgeState
from forge_hf.kernels.launch.gluon_launch import weight_layout_unsupported
from tests.core.test_state_8bit import _reloaded
from tests.helpers import DEVICE, exact_gradient, exact_inputs, stepped_layer

pytestmark = pytest.mark.usefixtures("single_thread")

EXTRA = {"rmsprop": dict(momentum=0.5), "adagrad": dict(initial_accumulator_value=0.1)}
LR = 1e-2
# the vectors: positive sums taken in another order (tile sums, atomics): entrywise fp32 round-off
VECTOR_RTOL = 1e-5
EXACT = DEVICE.type == "cpu"  # the interpreter's arithmetic is IEEE's, as torch's on CPU


def _trained(backend, rule="adamw", steps=3, shape=(70, 130), precision="log4_factored", **options):
    options = {"optimizer": rule, "state_precision": precision, "seed": 11, "backend": backend, "lr": LR,
               **EXTRA.get(rule, {}), **options}
    return stepped_layer(options, steps, False, shape)


def _factored(layer):
    (slot,) = [s for s in layer.forge_state.slots if isinstance(s, FactoredSlot)]
    return slot


def _assert_vectors_close(a, b, what):
    scale = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    assert float(((a - b).abs() / scale).max()) <= VECTOR_RTOL, what


@pytest.mark.parametrize("rule,shape", [("adamw", (70, 130)), ("adamw", (33, 71)), ("nadam", (70, 130)),
                                        ("radam", (70, 130)), ("rmsprop", (33, 71)), ("adagrad", (70, 130))])
def test_triton_matches_reference(rule, shape):
    """Every rule with a second moment, shapes that are not multiples of the tile: the first
    moment's codes and scales to the bit, the vectors to round-off, the weights as fp32 states'."""
    ref, tri = _trained("reference", rule, shape=shape), _trained("triton", rule, shape=shape)
    for a, b in zip(ref.forge_state.slots, tri.forge_state.slots):
        assert type(a) is type(b)
        if isinstance(a, codecs.QuantisedSlot):
            assert a.codec.name == "slog4"
            if EXACT:
                assert torch.equal(a.codes, b.codes) and torch.equal(a.meta.view(torch.int16), b.meta.view(torch.int16))
    _assert_vectors_close(_factored(ref).vectors, _factored(tri).vectors, rule)
    scale = ref.weight.detach().abs().max()
    assert float((tri.weight.detach() - ref.weight.detach()).abs().max() / scale) <= 1e-5


def test_vectors_are_the_ema_of_the_squared_gradients_sums(backend):
    """After step t the vectors are R_t = b2 R_{t-1} + (1 - b2) rowsum(g_t**2), C_t likewise,
    S_t their total: AdamW's EMA of v, kept as sums; the other sets are clear for step t + 1."""
    layer = _trained(backend, steps=0, shape=(70, 130))
    gen = torch.Generator().manual_seed(5)
    b2 = 0.999
    rows, cols = torch.zeros(70, dtype=torch.float64), torch.zeros(130, dtype=torch.float64)
    for step in range(1, 4):
        x, dy = exact_inputs((45, 130), 70, generator=gen, device=DEVICE)
        layer(x).backward(dy)
        g2 = exact_gradient(x, dy).cpu() ** 2
        rows, cols = b2 * rows + (1 - b2) * g2.sum(1), b2 * cols + (1 - b2) * g2.sum(0)
        slot = _factored(layer)
        r, c, s = slot.current(step)
        _assert_vectors_close(r.cpu().double(), rows, f"rows, step {step}")
        _assert_vectors_close(c.cpu().double(), cols, f"columns, step {step}")
        _assert_vectors_close(s.cpu().double().reshape(1), rows.sum().reshape(1), f"total, step {step}")
        assert not bool(slot.vectors[(step + 1) % 3].any())  # the set step + 1 sums into


def test_first_step_is_adamws(backend):
    """Step 1 reads V_0 = 0, so v = (1 - b2) g**2 elementwise: AdamW's first step, the very
    weight log4 gives (its v is stored only after the update)."""
    factored, full = _trained(backend, steps=1), _trained(backend, steps=1, precision="log4")
    assert torch.equal(factored.weight.detach(), full.weight.detach())
    assert torch.equal(factored.forge_state.slots[0].codes, full.forge_state.slots[0].codes)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the skipped tile
def test_nonfinite_tile_carries_its_moment(backend):
    """A skipped tile writes no weight or codes, and sums its V_{t-1} in unchanged: the rows it
    covers keep their R (to round-off), the others move on."""
    layer = _trained(backend, shape=(80, 100), steps=1)
    before = _factored(layer).current(1)[0].clone()
    x, dy = torch.randn(10, 100, device=DEVICE), torch.randn(10, 80, device=DEVICE)
    dy[3, 5] = float("nan")  # rows 0..63 (tile row 0) are poisoned
    layer(x).backward(dy)
    assert layer.forge_stats[1].item() == 2
    after = _factored(layer).current(2)[0]
    _assert_vectors_close(after[:64], before[:64], "skipped rows")
    assert not torch.allclose(after[64:], before[64:])


@pytest.mark.parametrize("resume_backend", ["reference", "triton"])
def test_checkpoint_resumes_bit_for_bit(resume_backend):
    """The vectors the next step reads saved and loaded exactly, under their own names; the
    resumed layer's next steps equal the uninterrupted one's."""
    a = _trained(resume_backend, steps=2, shape=(33, 71))
    sd = _reloaded(a.forge_state.state_dict())
    assert sd["precision"] == "log4_factored" and sd["exp_avg_codec"] == "slog4" and "exp_avg_sq" not in sd
    assert sd["exp_avg_sq_row"].shape == (33,) and sd["exp_avg_sq_col"].shape == (71,)
    b = _trained(resume_backend, steps=0, shape=(33, 71))
    b.weight.data.copy_(a.weight.data)
    b.forge_state.load_state_dict(sd, b.weight)
    assert torch.equal(_factored(b).current(2)[0], _factored(a).current(2)[0])
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        x, dy = exact_inputs((20, 71), 33, generator=gen, device=DEVICE)
        a(x).backward(dy)
        b(x).backward(dy)
    assert torch.equal(a.weight, b.weight) and torch.equal(_factored(a).vectors, _factored(b).vectors)
    assert torch.equal(a.forge_state.slots[0].codes, b.forge_state.slots[0].codes)


def test_bytes_a_parameter():
    """AdamW on a Llama-3.1-8B MLP shape: log4 m (0.53 bytes) and three fp32 vector sets."""
    param = torch.empty(14336, 4096, device="meta")
    state = ForgeState(get_rule("adamw"), "log4_factored", transposed=False)
    state.allocate(param, ForgeConfig().group())
    per_param = state.nbytes() / param.numel()
    assert 0.53125 < per_param < 0.53125 + 12 * (14336 + 4096 + 1) / param.numel() + 1e-9
    assert isinstance(state.slots[1], FactoredSlot) and state.slots[1].vectors.shape == (3, 14336 + 4096 + 1)


def test_non_fused_tensors_keep_full_states():
    """Norms, biases, embeddings: 16-bit states, as under the 8-bit and 4-bit precisions."""
    assert ForgeState(get_rule("adamw"), "log4_factored").stored_precision == "bf16"


def test_gluon_kernels_never_take_it():
    weight = torch.empty(128, 128, dtype=torch.bfloat16)
    slot = FactoredSlot.empty(128, 128, "cpu")
    reason = weight_layout_unsupported(weight, [None, slot, None], (codecs.NONE, codecs.FACTORED, codecs.NONE), 64)
    assert "factored" in reason


@pytest.mark.parametrize("options,match", [
    (dict(optimizer="lion"), "forge lion keeps none: use state_precision='log4'"),
    (dict(optimizer="sgd"), "forge sgd keeps none"),
    (dict(optimizer="rmsprop", hyperparameters=dict(centered=True)), "centered=True"),
])
def test_refusals_in_the_config(options, match):
    with pytest.raises(ValueError, match=match):
        ForgeConfig(state_precision="log4_factored", **options)


def test_refuses_a_one_dimensional_tensor():
    state = ForgeState(get_rule("adamw"), "log4_factored", transposed=False)
    with pytest.raises(ValueError, match="'log4_factored'.*2-d weight"):
        state.allocate(torch.zeros(64), ForgeConfig().group())


def test_refuses_tensor_parallel_pieces():
    """Tensor parallelism's pieces (rows or columns) are refused, naming the fix; row shards
    (data_parallel='sharded', FSDP2) step it (tests/optim/test_fsdp.py, test_distributed.py)."""
    with pytest.raises(ValueError, match=r"^state_precision='log4_factored' keeps whole-row and whole-column sums of "
                                         r"fused layer mlp.down_proj, which tensor parallelism splits: exclude it in "
                                         r"patch_model\(exclude=\[...\]\), or use state_precision='log4'$"):
        refuse_sharded("log4_factored", "mlp.down_proj", "tensor parallelism",
                       "exclude it in patch_model(exclude=[...])")
    refuse_sharded("log4", "mlp.down_proj", "tensor parallelism", "")  # other precisions: nothing to refuse


def test_row_shards_sum_their_column_shares_over_the_ranks(monkeypatch):
    """A row-sharded slot's launch sums its rows' share of the column sums; reduce_columns adds
    the ranks' (here two ranks' halves, added by hand): the read is one process's, to round-off.
    A rank without rows adds zero; a carried step keeps the rows' share; a whole step's clear
    leaves the next step's set at zero."""
    from forge_hf.core import factored

    torch.manual_seed(0)
    v = torch.rand(6, 5)
    whole = FactoredSlot.empty(6, 5, "cpu")
    whole.add(1, v)
    halves = [FactoredSlot.empty(3, 5, "cpu"), FactoredSlot.empty(3, 5, "cpu")]
    for half, rows in zip(halves, (v[:3], v[3:])):
        half.add(1, rows)
    shares = [h.vectors[factored.sum_set(1), 3:].clone() for h in halves]
    calls = []

    def all_reduce(t, group=None):
        calls.append(group)
        t.copy_(shares[0] + shares[1])

    monkeypatch.setattr(factored.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(factored.dist, "get_world_size", lambda group=None: 2)
    for half in halves:
        assert half.reduce_columns(1, "group") == 2 * 1 * 3 * 4  # a ring's 2 (W - 1) chunks of ceil(6 / 2) floats
    assert calls == ["group", "group"]
    read = torch.cat([h.read(2) for h in halves])
    torch.testing.assert_close(read, whole.read(2), rtol=1e-6, atol=0)

    empty = FactoredSlot.empty(0, 5, "cpu")
    empty.vectors.fill_(7.0)
    shares = [torch.zeros(6), torch.zeros(6)]
    empty.reduce_columns(1, "group")
    assert torch.equal(empty.vectors[factored.sum_set(1)], torch.zeros(6))

    half = halves[0]
    half.carry(2, sharded=True)  # the read set (whole C, S) into the step's: the rows' share only
    r, c, s = half.current(2)
    torch.testing.assert_close(s, v[:3].sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(c, half.read(2).sum(0), rtol=1e-6, atol=0)


def test_adagrad_fill_of_a_row_shard_is_the_whole_weights():
    """Adagrad's initial accumulator on a shard of 2 of 6 rows: every element reads ``fill``."""
    slot = FactoredSlot.empty(2, 5, "cpu", fill=0.1, whole_rows=6)
    torch.testing.assert_close(slot.read(1), torch.full((2, 5), 0.1), rtol=1e-6, atol=0)


def test_graphed_step_refuses_it_on_sharded_bands():
    """A CUDA graph would replay the column sums' all-reduce on one step's set: refused in one
    line naming the fixes (ForgeTrainer's cuda_graph=auto trains eagerly for the same reason)."""
    import types

    import forge_hf
    from forge_hf.optim.graphs import GraphedStep, sharded_factored

    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False))
    forge_hf.patch_model(model, state_precision="log4_factored", backend="reference", min_params=0)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2)
    assert sharded_factored(model) is None
    model[0].forge_dp = types.SimpleNamespace(mode="sharded", group=None)
    with pytest.raises(ValueError, match=r"^state_precision='log4_factored' on data_parallel='sharded' rows \(0\) "
                                         r"adds its column sums .*: use data_parallel='replicated' or "
                                         r"state_precision='log4' for a graphed step$"):
        GraphedStep(model, opt, warmup_steps=1)


def test_update_error_study_measures_it():
    """round_trip keeps a rank-1 second moment exactly (its row and column sums say all of it);
    the report names the factored slot, and trajectory_error runs the format."""
    from forge_hf.optim.quantization import quantization_report, round_trip, trajectory_error

    rank1 = torch.rand(16, 1) * torch.rand(1, 64)
    torch.testing.assert_close(round_trip(rank1, "log4_factored", False), rank1, rtol=1e-5, atol=0)
    report = quantization_report(precision="log4_factored", shape=(16, 128))
    assert report.codecs == {"exp_avg": "slog4", "exp_avg_sq": "factored"}
    stored = {"exp_avg_sq": lambda x: round_trip(x, "log4_factored", False)}
    error = trajectory_error(stored, shape=(16, 256), steps=20)
    assert 0 < error["mean"] < 10
