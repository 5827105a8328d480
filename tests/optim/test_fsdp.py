"""forge inside FSDP2: W gloo ranks under fully_shard (local batch b) against one process
with batch W*b (tests/workers/fsdp_worker.py runs each rank, every case in one launch)."""

import os
import re
import subprocess
import sys
import types

import pytest
import torch

import forge_hf
from forge_hf.optim.fsdp import chunk_rows, enable_fsdp
from forge_hf.optim.optimizer import fused_layers
from tests.helpers import ROOT, RTOL_FP32, WORKERS, bf16_ulps_apart
from tests.workers import fsdp_worker


def _launch(world, tmp_path):
    init = tmp_path / "rendezvous"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "fsdp_worker.py"), str(r), str(world), str(init),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _single_process(kind, dtype, precision, world, steps, rule="adamw"):
    model = fsdp_worker.build(kind, dtype, precision, rule)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        fsdp_worker.train_step(model, opt, kind, step, dtype, world, -1)
    return model, opt


def assert_close(got, ref, what):
    """The data-parallel tests' criterion: fused weights see the gathered tokens, biases
    FSDP2's averaged gradient (other summation orders than one process's)."""
    diff = (got.float().cpu() - ref.float().cpu()).abs() / ref.float().cpu().abs().max().clamp_min(1e-30)
    assert (diff <= RTOL_FP32).float().mean() >= 0.999, what
    assert diff.max() <= 1e-3, what


# a factored second moment's vectors (log4_factored): the ranks add their column sums in another
# order than one process's tiles, so these are one process's to fp32 round-off
FACTORED_KEYS = {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq_total"}


def assert_states(got: dict, ref: dict, exact: bool, what: str, rounded=()):
    """Two optimizers' state dicts: the same parameters and state names, equal values
    (``exact``: bit for bit, except the keys in ``rounded``; else assert_close)."""
    assert got.keys() == ref.keys(), what
    for i, ref_state in ref.items():
        assert got[i].keys() == ref_state.keys(), (what, i)
        for key, value in ref_state.items():
            if not torch.is_tensor(value):
                assert got[i][key] == value, (what, i, key)
            elif exact and key not in rounded:
                assert torch.equal(got[i][key], value), (what, i, key)
            else:
                assert_close(got[i][key], value, (what, i, key))


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3-rows-not-divisible"])
def launched(request, tmp_path_factory):
    return request.param, _launch(request.param, tmp_path_factory.mktemp(f"fsdp{request.param}"))


@pytest.mark.slow
@pytest.mark.parametrize("case", fsdp_worker.CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}-{c[3]}")
def test_sharded_training_follows_one_process(case, launched):
    """After STEPS steps every rank gathers the same weights, equal to one process trained
    on the concatenated batches (bit for bit for the exactly summable case, bf16 stochastic
    rounding and 8-bit and log4 states included: a row's bits do not depend on its rank); the
    gathered optimizer state is the single process's; resuming from it in a fresh sharded
    model steps as the run that went on (4-bit states: from each rank's rows through DCP too).
    Fused weights never hold a gradient, and the ranks' fused states together are exactly one
    process's (log4_factored: plus each rank's whole column sums; its vectors are one process's
    to fp32 round-off, the ranks adding the column sums in another order, and the bf16 weights
    that read them at most one step apart)."""
    world, ranks = launched
    kind, dtype, precision, rule = case
    got = [r[case] for r in ranks]
    for r in got:
        assert r["no_fused_grad"]
        for name, w in got[0]["weights"].items():
            assert torch.equal(w, r["weights"][name]), f"ranks gather different {name}"
        for name, w in r["final"].items():
            assert torch.equal(w, r["resumed"][name]), f"resuming changes the next step of {name}"
            if r["resumed_dcp"] is not None:  # each rank's rows saved and loaded through DCP
                assert torch.equal(w, r["resumed_dcp"][name]), f"the DCP checkpoint changes the next step of {name}"

    assert (got[0]["resumed_dcp"] is not None) == precision.startswith("log4")
    model, opt = _single_process(kind, dtype, precision, world, fsdp_worker.STEPS, rule)
    exact = kind == "exact"
    factored = precision == "log4_factored"
    for name, ref in model.state_dict().items():
        if exact and factored:  # the update reads the vectors (round-off): at most a bf16 step apart
            assert bf16_ulps_apart(got[0]["weights"][name], ref).max() <= 1, name
        elif exact:
            assert torch.equal(got[0]["weights"][name], ref), name
        else:
            assert_close(got[0]["weights"][name], ref, name)
    # log4 codes and scales bit for bit (a row's 64-element groups and rounding bits are its own)
    assert_states(got[0]["optimizer"]["state"], opt.state_dict()["state"], exact, case,
                  rounded=FACTORED_KEYS if factored else ())

    layers = list(fused_layers(model).values())
    single_state = sum(m.forge_state.nbytes() for m in layers)
    # a factored moment's column sums and total, 3 sets of them, are whole on every rank
    whole = sum(3 * (m.in_features + 1) * 4 for m in layers) if factored else 0
    assert sum(r["state_bytes"] for r in got) == single_state + (world - 1) * whole

    # what one rank sends per step for its fused layers: both activations, world - 1 chunks
    # of a ring all-gather, and the token counts (8 bytes: the number of calls, then each)
    tokens = fsdp_worker.LOCAL_BATCH * fsdp_worker.SEQ
    itemsize = torch.finfo(dtype).bits // 8
    expected = sum((world - 1) * tokens * (m.in_features + m.out_features) * itemsize for m in layers)
    expected += (world - 1) * 8 * (1 + len(layers))
    if factored:  # the ring all-reduce of K + 1 fp32 column sums and total: 2 (W - 1) chunks
        expected += sum(2 * (world - 1) * -(-(m.in_features + 1) // world) * 4 for m in layers)
    assert got[0]["bytes_sent"] == fsdp_worker.STEPS * expected


@pytest.mark.slow
@pytest.mark.parametrize("case", fsdp_worker.ACCUMULATE_CASES,
                         ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}-clip{c[3]}")
def test_accumulated_steps_follow_one_process(case, launched):
    """Gradient accumulation inside FSDP2: each fused layer gathers every rank's tokens at each
    micro-batch's backward and holds them for its shard's rows; the optimizer steps each shard
    once, after clipping the whole gradient (held rows and FSDP2's reduce-scattered shards,
    their squared sums added over the ranks). The same as one process accumulating the whole
    micro-batches: bit for bit on the exactly summable layer, to round-off otherwise, the norms too."""
    world, ranks = launched
    kind, dtype, precision, max_grad_norm = case
    got = [r["accumulated"][case] for r in ranks]
    for r in got:
        assert r["no_fused_grad"]
        for name, w in got[0]["weights"].items():
            assert torch.equal(w, r["weights"][name]), f"ranks gather different {name}"
        assert r["norms"] == got[0]["norms"]
    model = fsdp_worker.build(kind, dtype, precision)
    norms = fsdp_worker.train_accumulating(model, kind, dtype, world, -1, max_grad_norm)
    torch.testing.assert_close(torch.tensor(got[0]["norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
    if max_grad_norm:
        assert min(norms) > max_grad_norm  # the clip is active at every step
    for name, ref in model.state_dict().items():
        if kind == "exact":
            assert torch.equal(got[0]["weights"][name], ref), name
        else:
            assert_close(got[0]["weights"][name], ref, name)


@pytest.mark.slow
def test_embedding_under_fsdp2_steps_as_torch_adamw_on_the_dense_gradient(launched):
    """An input embedding (a padding index, rows seen and unseen) before a fused linear, fp32,
    under FSDP2: each rank's embedding rows take FSDP2's reduce-scattered dense gradient and
    the ordinary step (its reason said on the module; fuse_embedding=true refuses in one line),
    and the whole model equals torch.optim.AdamW on one process's dense gradients."""
    world, ranks = launched
    model = fsdp_worker.build_embedding(patched=False)
    start = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(fsdp_worker.STEPS):
        fsdp_worker.embedding_step(model, opt, step, world, -1)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    for r in ranks:
        got = r["embedding"]
        assert "its weight is a DTensor" in got["off"]
        assert re.fullmatch(r"fuse_embedding=true but 0 cannot be stepped from its compact rows: its weight is a "
                            r"DTensor .*; use fuse_embedding=auto or false", got["refused"])
        for name, w in got["weights"].items():
            assert torch.equal(w, ranks[0]["embedding"]["weights"][name]), f"ranks gather different {name}"
    got = ranks[0]["embedding"]["weights"]
    for name, w in ref.items():
        assert_close(got[name], w, name)
    looked_up = set(torch.cat([fsdp_worker.embedding_batch(step, world)[0].flatten()
                               for step in range(fsdp_worker.STEPS)]).tolist())
    assert fsdp_worker.PAD in looked_up
    seen = sorted(looked_up - {fsdp_worker.PAD})
    unseen = sorted(set(range(fsdp_worker.EMBED_VOCAB)) - set(seen))
    # rows without a gradient (never looked up, or the padding index) only decay
    torch.testing.assert_close(got["0.weight"][unseen], ref["0.weight"][unseen], rtol=RTOL_FP32, atol=0)
    assert not torch.equal(ref["0.weight"][unseen], start[unseen])
    moved = (got["0.weight"][seen] - start[seen]).abs().amax(1)
    assert (moved > 10 * (start[seen].abs().amax(1) * 1e-2 * 0.01 * fsdp_worker.STEPS)).all()


@pytest.mark.slow
def test_keeping_the_gathered_weight_after_backward_is_refused(launched):
    _, ranks = launched
    for r in ranks:
        assert r["refused"] is not None and "set_reshard_after_backward(False)" in r["refused"]


@pytest.mark.parametrize("n_rows,world", [(7, 3), (5, 4), (70, 3), (4, 2), (1, 2)])
def test_chunk_rows_is_torch_chunks_layout(n_rows, world):
    chunks = torch.arange(n_rows).chunk(world)
    for rank in range(world):
        start, stop = chunk_rows(n_rows, world, rank)
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == want


def _fake_fsdp(monkeypatch, layer, **overrides):
    """enable_fsdp's view of FSDP2 (optim/fsdp._fsdp_params) for one fused layer, without
    processes: a 1-d mesh, Shard(0), no offload, unless ``overrides`` say otherwise."""
    from torch.distributed.tensor import Shard

    from forge_hf.optim import fsdp

    mesh_info = types.SimpleNamespace(replicate_mesh_dim=overrides.get("replicate_mesh_dim"),
                                      shard_process_group=None)
    fsdp_param = types.SimpleNamespace(fsdp_placement=overrides.get("placement", Shard(0)),
                                       offload_to_cpu=overrides.get("offload", False))
    entry = (fsdp_param, types.SimpleNamespace(mesh_info=mesh_info))
    monkeypatch.setattr(fsdp, "_fsdp_params", lambda model: {(id(layer), "weight"): entry})


@pytest.mark.parametrize("overrides,message", [
    (dict(replicate_mesh_dim=0), r"fused layer 0 is under HSDP .*use fully_shard with a 1-d mesh"),
    (dict(placement="Shard(dim=1)"), r"fused layer 0 is sharded Shard\(dim=1\) .*shard fused weights Shard\(0\)"),
    (dict(offload=True), r"fused layer 0 has its shard offloaded .*drop offload_policy"),
])
def test_enable_fsdp_refuses_shardings_it_cannot_step(overrides, message, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False))
    forge_hf.patch_model(model, backend="reference", min_params=0)
    _fake_fsdp(monkeypatch, model[0], **overrides)
    with pytest.raises(ValueError, match=message):
        enable_fsdp(model)


def test_enable_fsdp_refuses_conv1d_and_forge_data_parallelism(monkeypatch):
    from transformers.pytorch_utils import Conv1D

    model = torch.nn.Sequential(Conv1D(6, 8))
    forge_hf.patch_model(model, backend="reference", min_params=0)
    _fake_fsdp(monkeypatch, model[0])
    with pytest.raises(ValueError, match=r"fused layer 0 stores its weight \(in, out\).*exclude it in patch_model"):
        enable_fsdp(model)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False))
    forge_hf.patch_model(model, backend="reference", min_params=0)
    model[0].forge_dp = types.SimpleNamespace(mode="sharded")
    _fake_fsdp(monkeypatch, model[0])
    with pytest.raises(ValueError, match=r"already has forge data parallelism .*do not call enable_data_parallel"):
        enable_fsdp(model)


def test_enable_fsdp_needs_fused_layers_under_fully_shard():
    plain = torch.nn.Sequential(torch.nn.Linear(8, 6))
    with pytest.raises(ValueError, match=r"Sequential has no fused layers: call forge_hf.patch_model"):
        enable_fsdp(plain)
    forge_hf.patch_model(plain, backend="reference", min_params=0)
    with pytest.raises(ValueError, match=r"fused layer 0 is not sharded by FSDP2: call fully_shard on it"):
        enable_fsdp(plain)


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv1'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,dtype,precision", [("mlp", torch.float32, "int8"), ("exact", torch.bfloat16, "bf16")])
def test_world_of_one_steps_like_no_sharding(kind, dtype, precision, one_process_group):
    """fully_shard over one rank: the fused layers step their whole weight as without FSDP2,
    bit for bit, and the optimizer state is the same."""
    plain, plain_opt = _single_process(kind, dtype, precision, 1, fsdp_worker.STEPS)
    model = fsdp_worker.shard(fsdp_worker.build(kind, dtype, precision), kind)
    opt = forge_hf.ForgeOptimizer(model, lr=1e-2, weight_decay=0.01)
    assert all(m.forge_dp.mode == "fsdp" for m in fused_layers(model).values())
    for step in range(fsdp_worker.STEPS):
        fsdp_worker.train_step(model, opt, kind, step, dtype, 1, 0)
    got = fsdp_worker.whole(model)
    for name, ref in plain.state_dict().items():
        assert torch.equal(got[name], ref), name
    assert_states(opt.state_dict()["state"], plain_opt.state_dict()["state"], True, kind)


def test_optimizer_steps_parameters_placed_otherwise(one_process_group):
    """A DTensor parameter not sharded by rows (a tensor-parallel piece: optim/tensor_parallel.py)
    is stepped through its local piece, as the same tensor without DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    def build(placed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
        forge_hf.patch_model(model, backend="reference", min_params=0, include=["0"])
        if placed:
            mesh = init_device_mesh("cpu", (1,))
            model[1].weight = torch.nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh, [Shard(1)]))
        return model, forge_hf.ForgeOptimizer(model, lr=1e-2, max_grad_norm=0.1)

    plain, plain_opt = build(False)
    placed, placed_opt = build(True)
    for step in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        plain(x).square().sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        hidden = DTensor.from_local(placed[0](x), placed[1].weight.device_mesh)  # replicated
        torch.nn.functional.linear(hidden, placed[1].weight).full_tensor().square().sum().backward()
        placed_opt.step()
        placed_opt.zero_grad()
        assert torch.equal(placed_opt.last_grad_norm, plain_opt.last_grad_norm)
    assert torch.equal(placed[1].weight.full_tensor(), plain[1].weight.detach())
    assert torch.equal(placed[0].weight, plain[0].weight)


@pytest.mark.parametrize("fsdp,distributed_type", [(["full_shard"], "NO"), ([], "FSDP")],
                         ids=["training-arguments", "accelerate-fsdp1"])
def test_trainer_refuses_fsdp1_and_points_to_fsdp2(fsdp, distributed_type):
    """FSDP other than version 2 (TrainingArguments' fsdp without version 2, an accelerator
    that is not FSDP2) is refused; the message names FSDP2, DDP and the loop that work
    (tests/integrations/test_fsdp_trainer.py runs FSDP2 through the Trainer)."""
    from accelerate.utils import DistributedType

    from forge_hf.integrations.trainer import check_training_arguments

    args = types.SimpleNamespace(gradient_accumulation_steps=1, fp16=False, deepspeed=None, fsdp=fsdp, n_gpu=1,
                                 auto_find_batch_size=False)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType(distributed_type))
    with pytest.raises(ValueError, match=r"^FSDP is not supported with forge optimizers through the Trainer .*"
                                         r"launch plain data parallelism \(DDP\).*run forge inside FSDP2 in your own "
                                         r"training loop \(patch_model, then torch's fully_shard, then "
                                         r"ForgeOptimizer: see forge_hf.optim.fsdp\)$"):
        check_training_arguments(args, accelerator)
