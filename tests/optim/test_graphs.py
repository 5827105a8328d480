"""GraphedStep: a training step replayed as one CUDA graph computes what the eager step
computes. On CPU: the input checks (the argument table's host work is tested in
tests/kernels/test_launch_args.py); on a GPU: graphed against eager training, bit for bit."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import forge_hf
from forge_hf.core.rules import get_rule, make_group
from forge_hf.kernels.runtime.launch_args import pack_args
from forge_hf.nn.loss import causal_lm_loss
from forge_hf.optim.graphs import CapturedAddresses, GraphedStep, check_batch
from forge_hf.optim.optimizer import fused_layers
from tests.helpers import bf16_ulps_apart

VOCAB, SEQ = 96, 24


def test_a_batch_must_match_the_captured_inputs():
    captured = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    check_batch(captured, {"input_ids": torch.ones(2, SEQ, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"shape \(2, 20\).*captured with \(2, 24\).*pad or pack"):
        check_batch(captured, {"input_ids": torch.zeros(2, 20, dtype=torch.long)})
    with pytest.raises(ValueError, match="torch.int32"):
        check_batch(captured, {"input_ids": torch.zeros(2, SEQ, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"keys \['input_ids'\].*\['input_ids', 'labels'\]"):
        check_batch(captured, {"input_ids": torch.zeros(2, SEQ, dtype=torch.long),
                               "labels": torch.zeros(2, SEQ, dtype=torch.long)})
    with pytest.raises(TypeError, match="list"):
        check_batch(captured, {"input_ids": [[1, 2]]})


def tiny_llama(seed=0, device="cpu"):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device)


def patched(device, state_precision="bf16", dtype=torch.float32, **optimizer_options):
    model = tiny_llama(device=device).to(dtype)
    forge_hf.patch_model(model, optimizer="adamw", state_precision=state_precision, min_params=0, lr=1e-3,
                         weight_decay=0.01)
    return model, forge_hf.ForgeOptimizer(model, lr=1e-3, weight_decay=0.01, **optimizer_options)


def test_graphed_step_refuses_what_it_cannot_replay():
    model, opt = patched("cpu", state_precision="fp32")
    with pytest.raises(TypeError, match="needs the model's ForgeOptimizer, got AdamW"):
        GraphedStep(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="warmup_steps=0"):
        GraphedStep(model, opt, warmup_steps=0)
    with pytest.raises(RuntimeError, match="the model is on cpu: CUDA graphs need a CUDA device"):
        GraphedStep(model, opt)
    _, strict = patched("cpu", state_precision="fp32", stop_on_nonfinite=True)
    with pytest.raises(ValueError, match="stop_on_nonfinite=True.*pop_nonfinite_tiles"):
        GraphedStep(model, strict)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"accumulation_steps={bad!r}: give the micro-batches a step"):
            GraphedStep(model, opt, accumulation_steps=bad)
    with pytest.raises(ValueError, match=r"accumulation_steps=2, but .*ForgeOptimizer\(model, ..., accumulate=True\)"):
        GraphedStep(model, opt, accumulation_steps=2)
    for i, group in enumerate(("tokens", "other")):  # as two enable_data_parallel calls leave them
        model.model.layers[i].mlp.down_proj.__dict__["forge_dp"] = SimpleNamespace(group=group)
    with pytest.raises(ValueError, match="data parallel over different process groups.*one group"):
        GraphedStep(model, opt)


def test_what_a_failed_capture_added_to_the_held_gradients_is_taken_back():
    """held_snapshot / held_restore, which GraphedStep wraps around each capture: a backward
    after the snapshot (a capture runs nothing, but its Python adds to the stash and may give
    parameters a gradient) is undone, and the step is the one of the first micro-batch alone."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    other = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    models = []
    for undo in (False, True):
        model, opt = patched("cpu", state_precision="fp32", accumulate=True, max_grad_norm=0.5)
        for m in fused_layers(model).values():
            # a stash: an fp32 buffer is added to in place, which a failed capture never runs but
            # this eager backward does
            m.forge_held.mode = "stash"
        causal_lm_loss(model, {"input_ids": ids, "labels": ids}).backward()
        if undo:
            snapshot = opt.held_snapshot()
            grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            causal_lm_loss(model, {"input_ids": other, "labels": other}).backward()
            opt.held_restore(snapshot)
            for p, g in zip(model.parameters(), grads):  # the gradient objects are back; a capture adds nothing to them
                if g is not None:
                    p.grad.copy_(g)
        opt.step()
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name


def test_a_step_counted_by_a_failed_capture_is_taken_back():
    """A capture can fail after the optimizer's Python counted a step: the ordinary path makes
    the rule's constants on the host (``prepare``), then copies them to the GPU from pageable
    memory, which a capture refuses. held_restore puts every state's count back, so the eager
    step that follows is the step of an optimizer that never tried."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    models, steps = [], []
    for undo in (False, True):
        model, opt = patched("cpu", state_precision="fp32")
        for _ in range(2):
            causal_lm_loss(model, {"input_ids": ids, "labels": ids}).backward()
            if undo:
                snapshot = opt.held_snapshot()
                for group in opt.param_groups:  # what the failed capture's Python counted
                    for p in group["params"]:
                        opt.rule.prepare(group, opt.state[p].host)
                opt.held_restore(snapshot)
            opt.step()
            opt.zero_grad()
        models.append(model)
        steps.append([state.step for state in opt.state.values()])
    assert steps[0] == steps[1] == [2] * len(steps[0])
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name


def test_graphed_step_refuses_a_ddp_wrapper(tmp_path):
    import torch.distributed as dist

    model, opt = patched("cpu", state_precision="fp32")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(TypeError, match="takes the model DDP wraps, not the DDP wrapper"):
            GraphedStep(wrapped, opt)
    finally:
        dist.destroy_process_group()


def test_the_captured_addresses_change_when_a_checkpoint_is_loaded(single_thread):
    """A replay writes where the capture saw the states: loading a checkpoint allocates new
    ones, which the replay's check must notice; the param-group dicts stay the same ones (the
    fused layers keep reading them), filled with the loaded values."""
    model, opt = patched("cpu", state_precision="int8")
    ids = torch.randint(0, VOCAB, (2, SEQ))

    def train_step():
        causal_lm_loss(model, dict(input_ids=ids, labels=ids)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()
    addresses = CapturedAddresses(model, opt)
    before = addresses.captured
    train_step()
    assert not addresses.moved()  # a step writes in place
    opt.load_state_dict(opt.state_dict())
    assert addresses.moved()
    after = addresses.read()
    assert after[0] != before[0] and after[1] == before[1]


@pytest.mark.parametrize("precision", ["log4", "log4_factored"])
def test_the_captured_addresses_read_every_kind_of_state(single_thread, precision):
    """4-bit codes and factored vectors are where a replay writes too: a load that replaces
    them is seen."""
    model, opt = patched("cpu", state_precision=precision)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    causal_lm_loss(model, dict(input_ids=ids, labels=ids)).backward()
    opt.step()
    addresses = CapturedAddresses(model, opt)
    assert not addresses.moved()
    opt.load_state_dict(opt.state_dict())
    assert addresses.moved()


def test_the_captured_addresses_change_when_a_parameter_or_its_data_is_replaced(single_thread):
    model, opt = patched("cpu")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    causal_lm_loss(model, dict(input_ids=ids, labels=ids)).backward()
    opt.step()
    layer = next(iter(fused_layers(model).values()))
    norm = model.model.norm
    for replace in (lambda: setattr(norm.weight, "data", norm.weight.data.clone()),  # model.to() moves data
                    lambda: setattr(norm, "weight", nn.Parameter(norm.weight.detach().clone())),
                    lambda: setattr(layer, "forge_stats", layer.forge_stats.clone())):
        addresses = CapturedAddresses(model, opt)
        assert not addresses.moved()
        replace()
        assert addresses.moved()


# ------------------------------------------------------------------------ GPU
# Under capture cuBLAS may pick other GEMM algorithms than eagerly (its workspace differs),
# so a whole model's gradients can differ from eager ones in the last bits. The fused steps
# themselves are checked bit for bit on layers whose inputs and output gradients do not
# come from a GEMM; a whole Llama is checked against eager training within tolerances.

SHAPES = [(70, 96, 33), (130, 200, 17), (33, 65, 40)]  # (out, in, tokens): no tile multiples


class ParallelLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n) for n, k, _ in SHAPES)

    def forward(self, xs):
        return [layer(x) for layer, x in zip(self.layers, xs)]


def parallel_loss(model, batch):
    """Each layer's output gradient is batch["c<i>"] exactly, whatever the GEMMs do."""
    outs = model([batch[f"x{i}"] for i in range(len(SHAPES))])
    return sum((out.float() * batch[f"c{i}"]).sum() for i, out in enumerate(outs))


def parallel_batches(n, dtype):
    gen = torch.Generator().manual_seed(5)
    return [{**{f"x{i}": torch.randn(t, k, generator=gen).to("cuda", dtype) for i, (_, k, t) in enumerate(SHAPES)},
             **{f"c{i}": torch.randn(t, m, generator=gen).cuda() for i, (m, _, t) in enumerate(SHAPES)}}
            for _ in range(n)]


def parallel_model(rule, state_precision, dtype, **optimizer_options):
    torch.manual_seed(0)
    model = ParallelLinears().cuda().to(dtype)
    report = forge_hf.patch_model(model, optimizer=rule, state_precision=state_precision, min_params=0, lr=1e-2,
                                  weight_decay=0.1)
    assert len(report.fused) == 3
    return model, forge_hf.ForgeOptimizer(model, **optimizer_options)


@pytest.mark.gpu
@pytest.mark.parametrize("k,max_grad_norm", [(1, 1.0), (3, 0.0), (2, 1.0)],
                         ids=["clipped", "accumulated", "accumulated-clipped"])
def test_clipped_and_accumulated_graphed_steps_follow_eager_steps(k, max_grad_norm):
    """Clipping and accumulation captured: k graphs a step, one per micro-batch, over 6 steps
    (one eager warm-up, a capture, replays), the learning rate changed every step. Unclipped,
    the held tokens are the eager run's and the fused steps are bit for bit; clipped, the norm
    is formed by GEMMs, which may round otherwise under capture: the norms agree to fp32
    round-off and the weights to a bf16 step."""
    eager, eager_opt = parallel_model("adamw", "bf16", torch.bfloat16, accumulate=k > 1, max_grad_norm=max_grad_norm)
    graphed, graphed_opt = parallel_model("adamw", "bf16", torch.bfloat16, accumulate=k > 1,
                                          max_grad_norm=max_grad_norm)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager_opt, graphed_opt)]
    step = GraphedStep(graphed, graphed_opt, loss_fn=parallel_loss, warmup_steps=1, accumulation_steps=k)
    batches = parallel_batches(6 * k, torch.bfloat16)
    for i in range(6):
        for batch in batches[i * k:(i + 1) * k]:
            parallel_loss(eager, batch).backward()
            step(batch)
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        torch.testing.assert_close(graphed_opt.last_grad_norm, eager_opt.last_grad_norm, rtol=1e-5, atol=0)
        if max_grad_norm:
            assert eager_opt.last_grad_norm > max_grad_norm  # the clip is active
    assert step.graph is not None and len(step.micros) == k and step.calls == 6 * k
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        if max_grad_norm:
            assert bf16_ulps_apart(a, b).max() <= 1, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("rule,state_precision,dtype", [("adamw", "bf16", torch.bfloat16),
                                                        ("adamw", "int8", torch.bfloat16),
                                                        ("adamw", "fp32", torch.float32),
                                                        ("nadam", "fp32", torch.float32)])
def test_graphed_steps_equal_eager_steps_bit_for_bit(rule, state_precision, dtype):
    """Seven steps (two eager warm-up, a capture, replays), the learning rate changed every
    step: fused weights, biases (stepped by ForgeOptimizer) and states bit-identical."""
    eager, eager_opt = parallel_model(rule, state_precision, dtype)
    graphed, graphed_opt = parallel_model(rule, state_precision, dtype)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager_opt, graphed_opt)]
    step = GraphedStep(graphed, graphed_opt, loss_fn=parallel_loss, warmup_steps=2)
    for batch in parallel_batches(7, dtype):
        parallel_loss(eager, batch).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        step(batch)
        for s in scheds:
            s.step()
        # per-tile squared sums are added atomically, in any order
        torch.testing.assert_close(graphed_opt.last_grad_norm, eager_opt.last_grad_norm, rtol=1e-5, atol=0)
    assert step.graph is not None and step.calls == 7
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(eager_opt.state_dict()["state"].values(), graphed_opt.state_dict()["state"].values()):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


@pytest.mark.gpu
def test_a_capture_grows_the_scratch_its_two_pass_layers_need_when_eager_steps_did_not(monkeypatch):
    """At 1024 tokens and more auto decides per layer shape; where eager steps take the fused
    path (their launches cost the host less) and captured steps the two-pass one, the eager
    warm-ups never grow the shared scratch buffer: the capture grows it first, and succeeds."""
    from forge_hf.kernels import dispatch, two_pass

    monkeypatch.delenv("FORGE_HF_WGRAD", raising=False)
    monkeypatch.setattr(dispatch, "_time_paths_ms", lambda paths: [run() for run in paths.values()] and {
        "fused": dispatch.PathTimes(0.03, 0.05), "two_pass": dispatch.PathTimes(0.02, 0.10)})
    dispatch.reset_wgrad_choices()
    try:
        two_pass._SCRATCH.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(96, 160)).cuda().bfloat16()
        forge_hf.patch_model(model, optimizer="adamw", state_precision="bf16", min_params=0, lr=1e-3)
        optimizer = forge_hf.ForgeOptimizer(model)
        loss_fn = lambda m, batch: (m(batch["x"]).float() * batch["c"]).sum()  # noqa: E731
        step = GraphedStep(model, optimizer, loss_fn=loss_fn, warmup_steps=2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            step({"x": torch.randn(1500, 96, generator=gen).cuda().bfloat16(),
                  "c": torch.randn(1500, 160, generator=gen).cuda()})
        assert step.graph is not None
        [choice] = dispatch.wgrad_choices().values()
        assert (choice.path, choice.graph_path) == ("fused", "two_pass")
        assert dispatch.scratch_for(model[0].weight.device).buffer.numel() >= 96 * 160
        assert torch.isfinite(model[0].weight).all()
    finally:
        dispatch.reset_wgrad_choices()


@pytest.mark.gpu
def test_a_wrong_batch_after_capture_is_refused_and_loses_nothing():
    model, opt = parallel_model("adamw", "bf16", torch.bfloat16)
    twin, twin_opt = parallel_model("adamw", "bf16", torch.bfloat16)
    step = GraphedStep(model, opt, loss_fn=parallel_loss, warmup_steps=1)
    batches = parallel_batches(3, torch.bfloat16)
    for batch in batches[:2]:
        step(batch)
    counters = [s.step for s in opt.state.values()]
    short = {k: v[:-1] for k, v in batches[2].items()}
    with pytest.raises(ValueError, match="pad or pack"):
        step(short)
    assert [s.step for s in opt.state.values()] == counters
    step(batches[2])
    for batch in batches:
        parallel_loss(twin, batch).backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    for a, b in zip(twin.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_a_launched_replay_lets_out_its_own_loss_and_joins_to_its_update():
    """launch() returns this replay's loss, read after the forward (a kernel sleeping at the
    end of the forward makes a read that did not wait see the last replay's loss), and after
    join() the weights are those of the eager steps, bit for bit (the output gradients are
    the batch's, whatever the GEMMs do)."""
    model, opt = parallel_model("adamw", "bf16", torch.bfloat16)
    twin, twin_opt = parallel_model("adamw", "bf16", torch.bfloat16)

    def slow_forward_loss(model, batch):
        loss = parallel_loss(model, batch)
        torch.cuda._sleep(20_000_000)  # tens of milliseconds before the loss's event
        return loss

    step = GraphedStep(model, opt, loss_fn=slow_forward_loss, warmup_steps=1)
    batches = parallel_batches(5, torch.bfloat16)
    for batch in batches:
        loss = step.launch(batch)
        early = loss.item()  # on the current stream: waits for the loss's event, not the backward
        step.join()
        torch.cuda.synchronize()
        if step.graph is not None:  # the warm-up step runs eagerly: no captured loss
            assert early == step.loss.item() == loss.item()
        parallel_loss(twin, batch).backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    for a, b in zip(twin.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _batches(n, batch=2):
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": ids.cuda(), "labels": ids.cuda()}
            for ids in (torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(n))]


@pytest.fixture
def deterministic_attention():
    """SDPA's math backend (matmuls and a softmax): the fused attention kernels' backward
    may add in any order. Without a padding mask SDPA needs no mask tensor (eager attention
    copies one from the host, which a capture refuses)."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic_attention")
@pytest.mark.parametrize("state_precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_graphed_llama_training_follows_eager_training(state_precision, dtype):
    """A whole model: every step's loss, and each parameter's change over six steps, as in
    eager training up to the GEMMs' rounding (a step missed, repeated or run with another
    learning rate or step count changes the updates by far more than the tolerance)."""
    eager, eager_opt = patched("cuda", state_precision, dtype)
    graphed, graphed_opt = patched("cuda", state_precision, dtype)
    start = [p.detach().clone() for p in eager.parameters()]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager_opt, graphed_opt)]
    step = GraphedStep(graphed, graphed_opt, warmup_steps=2)
    for i, batch in enumerate(_batches(6)):
        loss = causal_lm_loss(eager, batch)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        graphed_loss = step(batch)
        for s in scheds:
            s.step()
        torch.testing.assert_close(graphed_loss, loss.detach(), rtol=1e-3, atol=0, msg=f"loss of step {i}")
    for (name, a), b, a0 in zip(eager.named_parameters(), graphed.parameters(), start):
        moved = (a.float() - a0.float()).norm()
        apart = (b.float() - a.float()).norm()
        assert apart <= 0.05 * moved, f"{name}: {apart:.3e} apart after moving {moved:.3e}"


@pytest.mark.gpu
def test_a_replay_after_loading_a_checkpoint_is_refused():
    model, opt = parallel_model("adamw", "bf16", torch.bfloat16)
    step = GraphedStep(model, opt, loss_fn=parallel_loss, warmup_steps=1)
    batches = parallel_batches(4, torch.bfloat16)
    for batch in batches[:2]:
        step(batch)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="Build a new GraphedStep"):
        step(batches[2])
    fresh = GraphedStep(model, opt, loss_fn=parallel_loss, warmup_steps=1)
    fresh(batches[2])
    fresh(batches[3])  # captures anew, on the loaded states
    assert fresh.graph is not None


@pytest.mark.gpu
def test_a_dropped_graphed_step_gives_its_memory_back():
    """Model, states, captured inputs and the graph's pool all go with the last reference
    (a first round warms what the process keeps for good: cuBLAS's workspace of the
    warm-up stream, compiled kernels)."""
    import gc

    def train_and_drop():
        model, opt = parallel_model("adamw", "bf16", torch.bfloat16)
        step = GraphedStep(model, opt, loss_fn=parallel_loss, warmup_steps=1)
        for batch in parallel_batches(3, torch.bfloat16):
            step(batch)
        torch.cuda.synchronize()

    train_and_drop()
    gc.collect()
    before = torch.cuda.memory_allocated()
    train_and_drop()
    gc.collect()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_a_kernel_first_needed_during_a_capture_is_refused_clearly():
    from forge_hf.kernels.dispatch import launch_fused_update

    w = torch.zeros(40, 24, device="cuda")  # fp32 weight, (32, 32, 32) tiles: a variant nothing ran
    x, dy = torch.ones(8, 24, device="cuda"), torch.ones(8, 40, device="cuda")
    rule = get_rule("adamw")
    args = pack_args(rule.prepare(make_group(rule, {}), rule.host_init()), 1, 0, "cuda")
    stats = torch.zeros(2, device="cuda")
    slots = [torch.zeros_like(w), torch.zeros_like(w), None]
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="cannot be compiled: run an eager step"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            launch_fused_update(x, dy, w, slots, args, stats, "adamw", True, blocks=(32, 32, 32))
    assert torch.all(w == 0)  # nothing ran
