"""ForgeEmbedding (nn/embedding.py, nn/compact_rows.py) and its step (optim/embedding_step.py):
the compact rows are the dense gradient's, and the step over every row from them is
torch.optim's on the dense gradient, bit for bit the ordinary path's, with accumulation,
clipping, checkpoints and torch.compile; the fuse_embedding option and its refusals."""

import copy
import io

import pytest
import torch
from torch import nn

from forge_hf.core.config import OptionError
from forge_hf.nn.compact_rows import compact_rows
from forge_hf.nn.embedding import ForgeEmbedding
from forge_hf.optim import embedding_step
from forge_hf.optim.embedding_step import EmbeddingSteps
from forge_hf.optim.optimizer import ForgeOptimizer
from forge_hf.optim.patch import patch_model, unpatch_model
from tests.helpers import DEVICE, RTOL_FP32, assert_close_rel, tiny_llama

VOCAB, HIDDEN, PAD = 1000, 48, 3  # a vocabulary no multiple of a tile (64 rows) or a chunk


class Toy(nn.Module):
    """An embedding and a head: patch_model fuses the head and, with fuse_embedding, the embedding."""

    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD, dtype=dtype)
        self.head = nn.Linear(HIDDEN, 16, bias=False, dtype=dtype)
        self.to(DEVICE)

    def forward(self, ids):
        return self.head(self.emb(ids))


def batches(n, seed=1):
    """Ids over the first 300 rows only (the rest never seen), padding included; each other id
    once a batch, so that a row's gradient has one term whatever order a GPU adds in (the
    repeats' sums: test_compact_rows_are_the_dense_gradient)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randperm(300, generator=gen)[:60].view(3, 20)
        ids[:, -4:] = PAD
        out.append(ids.to(DEVICE))
    return out


def loss_of(model, ids):
    return model(ids).float().square().mean()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 128 rows: a 1000-row vocabulary takes 8, the last of 104."""
    monkeypatch.setattr(EmbeddingSteps, "CHUNK", 128 * HIDDEN)


def forge_run(backend, fuse, dtype=torch.float32, steps=3, micro=1, **opt):
    model = Toy(dtype)
    patch_model(model, backend=backend, min_params=0, fuse_embedding=fuse)
    optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1, **opt)
    data = batches(steps * micro)
    for i, ids in enumerate(data):
        loss_of(model, ids).backward()
        if (i + 1) % micro == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def test_compact_rows_are_the_dense_gradient():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 300), generator=gen).to(DEVICE)  # each id ~48 times
    ids[:, -4:] = PAD
    dy = torch.randn(*ids.shape, HIDDEN, generator=gen).to(DEVICE)
    held = compact_rows(ids, dy, VOCAB, PAD, torch.float32)
    assert held.ids.shape[0] == min(ids.numel(), VOCAB + 1)  # known before any kernel runs
    weight = torch.zeros(VOCAB, HIDDEN, requires_grad=True, device=DEVICE)
    torch.nn.functional.embedding(ids, weight, padding_idx=PAD).backward(dy)
    dense = torch.zeros(VOCAB + 1, HIDDEN, device=DEVICE).index_add_(0, held.ids, held.rows)[:VOCAB]
    # torch's bits, in its order of adding, on either device; the same bits every time (on CUDA
    # float atomics would add a row's ~48 terms in an order that changes from run to run)
    assert torch.equal(dense, weight.grad) and not dense[PAD].any()
    assert all(torch.equal(compact_rows(ids, dy, VOCAB, PAD, torch.float32).rows, held.rows) for _ in range(20))


def test_step_is_torch_adamw_on_the_dense_gradient(backend, small_chunks):
    model, _ = forge_run(backend, "true", steps=4)
    assert isinstance(model.emb, ForgeEmbedding) and model.emb.weight.grad is None
    twin = Toy()
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for ids in batches(4):
        loss_of(twin, ids).backward()
        opt.step()
        opt.zero_grad()
    assert_close_rel(model.emb.weight, twin.emb.weight, RTOL_FP32, "embedding")
    # rows never seen moved too (weight decay, and momentum of nothing: as torch's zero gradient)
    start = Toy().emb.weight
    assert not torch.equal(model.emb.weight[500:], start[500:])
    assert_close_rel(model.emb.weight[500:], twin.emb.weight[500:], RTOL_FP32, "unseen rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_for_bit_the_ordinary_path(backend, small_chunks, dtype):
    fused, opt = forge_run(backend, "true", dtype)
    plain, plain_opt = forge_run(backend, "false", dtype)
    assert type(plain.emb) is nn.Embedding
    assert torch.equal(fused.emb.weight, plain.emb.weight) and torch.equal(fused.head.weight, plain.head.weight)
    for a, b in zip(opt.state[fused.emb.weight].slots, plain_opt.state[plain.emb.weight].slots):
        assert (a is None) == (b is None) and (a is None or (a.dtype == dtype and torch.equal(a, b)))


def test_accumulation_and_clipping_are_the_ordinary_paths(small_chunks):
    fused, opt = forge_run("reference", "true", micro=2, accumulate=True, max_grad_norm=0.05)
    plain, plain_opt = forge_run("reference", "false", micro=2, accumulate=True, max_grad_norm=0.05)
    assert torch.equal(fused.emb.weight, plain.emb.weight)
    assert torch.equal(opt.last_grad_norm, plain_opt.last_grad_norm)


def test_tiny_llama_trains_to_the_same_weights(backend):
    models = []
    for fuse in ("auto", "false"):
        model = tiny_llama(100).to(DEVICE)
        report = patch_model(model, backend=backend, min_params=0, fuse_embedding=fuse)
        optimizer = ForgeOptimizer(model, lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):  # each id once a batch: one term a row, whatever order a GPU adds in
            ids = torch.randperm(100, generator=gen)[:16].view(2, 8).to(DEVICE)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        models.append((model, report))
    (on, report_on), (off, report_off) = models
    assert isinstance(on.model.embed_tokens, ForgeEmbedding) and type(off.model.embed_tokens) is nn.Embedding
    for (name, a), b in zip(on.named_parameters(), off.parameters()):
        assert torch.equal(a, b), name
    assert ("embedding model.embed_tokens (100 x 32): stepped from the rows each batch touches, its 12.5 KiB "
            "dense gradient never allocated") in str(report_on)
    assert "embedding model.embed_tokens (100 x 32): ordinary path: fuse_embedding=false" in str(report_off)
    assert unpatch_model(on)[-1] == "model.embed_tokens" and type(on.model.embed_tokens) is nn.Embedding


def test_tied_embeddings_stay_on_the_ordinary_path():
    from transformers import LlamaForCausalLM

    config = tiny_llama(100).config
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config).to(DEVICE)
    report = patch_model(model, backend="reference", min_params=0)
    assert type(model.model.embed_tokens) is nn.Embedding
    assert "ordinary path: its weight is also lm_head.weight (tied input and output embeddings)" in str(report)
    with pytest.raises(ValueError) as e:
        patch_model(LlamaForCausalLM(config), min_params=0, fuse_embedding=True)
    message = str(e.value)
    assert "\n" not in message and message.startswith("fuse_embedding=true but model.embed_tokens cannot")
    assert "use fuse_embedding=auto" in message


@pytest.mark.parametrize("kwargs, why", [(dict(max_norm=1.0), "max_norm"), (dict(sparse=True), "sparse=True"),
                                         (dict(scale_grad_by_freq=True), "scale_grad_by_freq")])
def test_true_refuses_what_cannot_be_exact(kwargs, why):
    model = Toy()
    model.emb = nn.Embedding(VOCAB, HIDDEN, **kwargs, device=DEVICE)
    with pytest.raises(ValueError, match=f"fuse_embedding=true but emb cannot be stepped .*{why}.*auto"):
        patch_model(model, min_params=0, fuse_embedding="true")
    assert type(model.head) is nn.Linear  # nothing changed
    report = patch_model(model, min_params=0)
    assert type(model.emb) is nn.Embedding and why in str(report)


def test_bad_values_and_several_processes(monkeypatch):
    with pytest.raises(OptionError, match=r"unknown fuse_embedding='ture'.*did you mean 'true'"):
        patch_model(Toy(), fuse_embedding="ture")
    monkeypatch.setattr(embedding_step.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(embedding_step.dist, "get_world_size", lambda: 2)
    model = Toy()
    patch_model(model, min_params=0, backend="reference", fuse_embedding="true")
    with pytest.raises(ValueError, match="fuse_embedding=true but emb cannot be stepped from its compact rows: "
                                         "several processes"):
        ForgeOptimizer(model)
    report = patch_model(model := Toy(), min_params=0, backend="reference")
    ForgeOptimizer(model)
    assert "embedding emb (1000 x 48): ordinary path: several processes" in str(report)
    model.emb(batches(1)[0]).sum().backward()
    assert model.emb.weight.grad is not None  # the dense gradient, for DDP to average


def test_checkpoint_resumes_exactly(small_chunks):
    model, opt = forge_run("reference", "true", steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), io.BytesIO()
    torch.save(opt.state_dict(), saved_opt)
    plain, plain_opt = forge_run("reference", "false", steps=2)
    assert opt.state_dict()["state"].keys() == plain_opt.state_dict()["state"].keys()
    more = batches(2, seed=7)
    for ids in more:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
    resumed = Toy()
    patch_model(resumed, backend="reference", min_params=0, fuse_embedding="true")
    resumed.load_state_dict(saved_model)
    resumed_opt = ForgeOptimizer(resumed, lr=1e-2, weight_decay=0.1)
    saved_opt.seek(0)
    resumed_opt.load_state_dict(torch.load(saved_opt))
    for ids in more:
        loss_of(resumed, ids).backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
    assert torch.equal(resumed.emb.weight, model.emb.weight)


def test_rows_are_held_until_step_and_let_go_by_zero_grad():
    model = Toy()
    patch_model(model, backend="reference", min_params=0)
    before = model.emb(batches(1)[0]).detach()  # no optimizer yet: a plain lookup
    optimizer = ForgeOptimizer(model, lr=1e-2)
    assert torch.equal(model.emb(batches(1)[0]).detach(), before)
    loss_of(model, batches(1)[0]).backward()
    snapshot = optimizer.held_snapshot()
    assert model.emb.forge_rows is not None and model.emb.weight.grad is None
    optimizer.zero_grad()
    assert model.emb.forge_rows is None
    optimizer.held_restore(snapshot)
    assert model.emb.forge_rows is not None
    copied = copy.deepcopy(model)  # a copy is plain until an optimizer takes it
    loss_of(copied, batches(1)[0]).backward()
    assert copied.emb.weight.grad is not None


def test_compiles_without_a_graph_break(single_thread):
    results = []
    for compiled in (False, True):
        model = tiny_llama(100).to(DEVICE)
        patch_model(model, backend="reference", min_params=0)
        optimizer = ForgeOptimizer(model, lr=1e-2)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            ids = torch.randint(0, 100, (2, 8), generator=gen).to(DEVICE)
            run(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(model.model.embed_tokens.weight.detach().clone())
    if DEVICE.type == "cpu":
        assert torch.equal(*results)
    else:  # CUDA: the compiled forward and backward are other kernels, whose fp32 sums round otherwise
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
