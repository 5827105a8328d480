"""The fused embedding's states in the layer precision (optim/embedding_step.py, core/row_slots.py):
under int8 and al8 its weight, codes and metadata after several steps are the ordinary path's
bit for bit on the same parameter with the same precision (a fused layer's weight stepped from
a dense gradient keeps its 8-bit states so), in chunks that split neither a tile nor a codec
block; checkpoints resume exactly; the report says the precision."""

import copy
import io

import pytest
import torch
from torch import nn

from forge_hf.core.codecs import BLOCK, CODECS, QuantisedSlot, meta_layout
from forge_hf.core.row_slots import RowSlots, Staging
from forge_hf.core.state import ForgeState
from forge_hf.nn.embedding import ForgeEmbedding
from forge_hf.optim.embedding_step import EmbeddingSteps
from forge_hf.optim.optimizer import ForgeOptimizer
from forge_hf.optim.patch import patch_model
from tests.helpers import DEVICE
from tests.nn.test_embedding import PAD, VOCAB, batches  # ids over the first 300 rows, padding included

pytestmark = pytest.mark.usefixtures("single_thread")

# VOCAB: no multiple of a tile (64 rows) or a chunk (128 rows). Two codec blocks a row,
# the second partial, so a chunk's metadata is two block columns the whole weight's rows apart
HIDDEN = 80


class Toy(nn.Module):
    def __init__(self, dtype=torch.float32, read_weight=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD, dtype=dtype)
        self.head = nn.Linear(HIDDEN, 16, bias=False, dtype=dtype)
        self.read_weight = read_weight  # the weight read outside the module too: a dense gradient as well
        self.to(DEVICE)

    def forward(self, ids):
        out = self.head(self.emb(ids))
        return out + self.emb.weight[5:7].sum() if self.read_weight else out


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 128 rows: the vocabulary takes 8, the last of 104."""
    monkeypatch.setattr(EmbeddingSteps, "CHUNK", 128 * HIDDEN)


def train(model, optimizer, data, bad=False):
    for ids in data:
        model(ids).float().square().mean().backward()
        if bad:  # a non-finite gradient in a row the batch touched, in either path's gradient
            bad_row = int(ids[0, 0])
            rows = getattr(model.emb, "forge_rows", None)
            if rows is not None:
                rows.rows[(rows.ids == bad_row).nonzero()[0, 0], 0] = float("inf")
            else:
                model.emb.weight.grad[bad_row, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()


def run(backend, fuse, precision, dtype=torch.float32, steps=3, read_weight=False, bad=False):
    """A Toy trained ``steps`` steps. On the ordinary path its embedding's state is marked a
    row-major weight's, so it keeps the layer precision as a fused layer's weight on that path does."""
    model = Toy(dtype, read_weight)
    patch_model(model, backend=backend, min_params=0, fuse_embedding=fuse, state_precision=precision)
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
    optimizer.state[model.emb.weight].transposed = False
    train(model, optimizer, batches(steps), bad)
    return model, optimizer


def assert_same_states(a: ForgeState, b: ForgeState, codecs: set):
    assert {s.codec.name for s in a.slots if s is not None} == codecs
    for x, y in zip(a.slots, b.slots):
        assert (x is None) == (y is None)
        if x is not None:
            assert isinstance(x, QuantisedSlot) and x.codec == y.codec
            assert torch.equal(x.codes, y.codes)
            assert torch.equal(x.meta.view(torch.uint8), y.meta.view(torch.uint8))  # al8's words are bits


PRECISION_CODECS = {"int8": {"absmax8", "absmax8_floored"}, "al8": {"absmax8", "al8"}, "log4": {"slog4", "log4"}}


@pytest.mark.parametrize("precision", ["int8", "al8", "log4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_8bit_states_are_the_ordinary_paths(backend, small_chunks, precision, dtype):
    fused, opt = run(backend, "true", precision, dtype)
    plain, plain_opt = run(backend, "false", precision, dtype)
    assert isinstance(fused.emb, ForgeEmbedding) and type(plain.emb) is nn.Embedding
    assert torch.equal(fused.emb.weight, plain.emb.weight) and torch.equal(fused.head.weight, plain.head.weight)
    state = opt.state[fused.emb.weight]
    assert_same_states(state, plain_opt.state[plain.emb.weight], PRECISION_CODECS[precision])
    m = state.slots[0]  # the first moment: rows seen have codes, rows never seen (and padding) none
    assert m.meta.shape == (VOCAB, -(-HIDDEN // BLOCK), 1)
    assert m.codes[:300].any() and not m.codes[300:].any() and not m.codes[PAD].any()
    assert not torch.equal(fused.emb.weight[300:], Toy(dtype).emb.weight[300:])  # weight decay moved them


@pytest.mark.parametrize("precision", ["int8", "al8", "log4"])
def test_a_non_finite_row_is_skipped_as_the_ordinary_path_skips_it(backend, small_chunks, precision):
    fused, opt = run(backend, "true", precision, steps=2, bad=True)
    plain, plain_opt = run(backend, "false", precision, steps=2, bad=True)
    assert torch.equal(fused.emb.weight, plain.emb.weight)
    assert_same_states(opt.state[fused.emb.weight], plain_opt.state[plain.emb.weight], PRECISION_CODECS[precision])
    assert opt.pop_nonfinite_tiles() == plain_opt.pop_nonfinite_tiles() > 0


def test_a_weight_read_elsewhere_takes_the_ordinary_path_with_its_codes(small_chunks):
    fused, opt = run("reference", "true", "int8", read_weight=True)
    plain, plain_opt = run("reference", "false", "int8", read_weight=True)
    assert torch.equal(fused.emb.weight, plain.emb.weight)
    assert_same_states(opt.state[fused.emb.weight], plain_opt.state[plain.emb.weight], PRECISION_CODECS["int8"])


@pytest.mark.parametrize("precision", ["int8", "al8", "log4"])
def test_checkpoint_resumes_exactly(small_chunks, precision):
    model, opt = run("reference", "true", precision, dtype=torch.bfloat16, steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), io.BytesIO()
    sd = opt.state_dict()
    index = [p for group in opt.param_groups for p in group["params"]].index(model.emb.weight)
    saved = sd["state"][index]
    assert saved["precision"] == precision and saved["exp_avg_codec"] in PRECISION_CODECS[precision]
    torch.save(sd, saved_opt)
    more = batches(2, seed=7)
    train(model, opt, more)
    resumed = Toy(torch.bfloat16)
    patch_model(resumed, backend="reference", min_params=0, fuse_embedding="true", state_precision=precision)
    resumed.load_state_dict(saved_model)
    resumed_opt = ForgeOptimizer(resumed, lr=1e-2, weight_decay=0.1)
    saved_opt.seek(0)
    resumed_opt.load_state_dict(torch.load(saved_opt))
    train(resumed, resumed_opt, more)
    assert torch.equal(resumed.emb.weight, model.emb.weight)
    assert_same_states(resumed_opt.state[resumed.emb.weight], opt.state[model.emb.weight], PRECISION_CODECS[precision])


def test_report_and_bytes_follow_the_precision():
    kept = {}
    for precision in ("bf16", "int8"):
        model = Toy(torch.bfloat16)
        report = patch_model(model, backend="reference", min_params=0, state_precision=precision)
        assert f"dense gradient never allocated (fuse_embedding); states {precision}" in str(report)
        opt = ForgeOptimizer(model, lr=1e-2)
        train(model, opt, batches(1))
        kept[precision] = opt.state[model.emb.weight].nbytes()
    blocks = -(-HIDDEN // BLOCK)
    assert kept == {"bf16": 2 * VOCAB * HIDDEN * 2, "int8": 2 * (VOCAB * HIDDEN + VOCAB * blocks * 4)}
    report = patch_model(Toy(), backend="reference", min_params=0, state_precision="al8", fuse_embedding="false")
    assert "ordinary path: fuse_embedding=false; states bf16" in str(report)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_row_slots_stage_the_metadata_in_the_rows_own_layout(codec):
    """Any codec: a chunk's codes are views of the slot's rows, its metadata a staged copy in
    the layout the kernels require of a weight of those rows, written back by store()."""
    weight = torch.zeros(300, 200)
    slot = QuantisedSlot.empty_like(weight, CODECS[codec], transposed=False)
    slot.meta.copy_(torch.randn(slot.meta.shape))
    plain = torch.randn(300, 200)
    chunk = RowSlots([slot, plain, None], slice(128, 256), 200, Staging())
    staged, rows, none = chunk.slots
    assert staged.codes.data_ptr() == slot.codes[128].data_ptr() and rows.data_ptr() == plain[128].data_ptr()
    assert none is None and (staged.meta.shape, staged.meta.stride()) == meta_layout(128, 200, slot.codec)
    chunk.load()
    assert torch.equal(staged.meta, slot.meta[128:256])
    staged.meta.add_(1)
    before = slot.meta.clone()
    chunk.store()
    assert torch.equal(slot.meta[128:256], before[128:256] + 1)
    assert torch.equal(slot.meta[:128], before[:128]) and torch.equal(slot.meta[256:], before[256:])
