"""ForgeOptimizer: the torch.optim.Optimizer facade of a patched model.

Its param_groups own the hyperparameters: they hold every trainable parameter, fused
weights included, and each fused layer's ``forge_group`` *is* the group dict holding its
weight (set once, here), so any LR scheduler drives the fused step. ``step()`` updates only
what has a ``.grad`` (embeddings, norms, biases, layers left unpatched or with fusion
switched off): the fused weights were already stepped in backward and have none. Those
tensors are stepped by the same rule code the kernels run (``kernels/reference.py``),
with the same state (ForgeState) and stores, so each rule stays written once.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.codecs import QuantisedSlot
from ..core.factored import FactoredSlot, reduce_factored_columns
from ..core.rounding import layer_salt
from ..core.state import ForgeState, slots_key
from ..kernels import (
    BoundLaunch,
    MultiTensorRulePass,
    batch_kind,
    next_launch_args,
    reference_fused_update,
    reference_rule_rows,
    release_held_args,
    resolve_backend,
)
from ..nn.held_buffer import HELD_ADDS, AddCounts
from ..nn.held_gradient import held_for
from ..nn.linear import FusedWeightMixin
from .embedding_step import EmbeddingSteps
from .fsdp import enable_fsdp, fsdp_needed, param_shards
from .tensor_parallel import all_reduce_over, settle_gradients

# Trainer.get_decay_parameter_names (transformers 5.x): no weight decay for biases and norms.
# data-parallel modes in which a fused layer holds and steps only its rows (optim/distributed.py, optim/fsdp.py)
SHARDED_MODES = ("sharded", "fsdp")
LOOP_SAYS = 0  # accumulation_steps of ForgeOptimizer(accumulate=True): the loop that drives it gives the count
NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def fused_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's fused layers (ForgeLinear, ForgeConv1D) by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedWeightMixin)}


def default_decay_parameter_names(model: nn.Module) -> list[str]:
    """Hugging Face's decay grouping: every parameter outside LayerNorms and not named like
    a bias or a norm."""
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [nn.LayerNorm], NO_DECAY_PATTERNS)


def _norm_groups(layer) -> tuple:
    """The process groups a fused layer's squared sums add over: its data-parallel band's
    (each rank steps its rows) and its tensor-parallel mesh's (each rank holds a piece)."""
    dp, tp = layer.forge_dp, layer.forge_tp
    groups = (dp.group,) if dp is not None and dp.mode in SHARDED_MODES else ()
    return groups + (tp.norm_groups if tp is not None else ())


def _one(layers: dict[str, nn.Module], what: str, read) -> object:
    values = {read(m) for m in layers.values()}
    if len(values) != 1:
        raise ValueError(
            f"the model's fused layers use different {what} ({sorted(map(str, values))}) but one "
            f"ForgeOptimizer steps one {what}: patch the whole model with a single patch_model call"
        )
    return values.pop()


class ForgeOptimizer(torch.optim.Optimizer):
    """``ForgeOptimizer(model, lr=..., weight_decay=..., betas=..., eps=...)``.

    Args:
        model: a model patched by ``patch_model`` (the rule, state precision, rounding and
            backend are those of its ForgeConfig).
        lr: the learning rate; with ``**hyperparameters``, torch.optim's names (``betas``,
            ``eps``, ``weight_decay``, ``momentum``, ...). Unset ones default to the values
            given to patch_model, then to the rule's.
        decay_parameter_names: the parameters that take weight decay (default: Hugging
            Face's grouping: not biases and norms).
        stop_on_nonfinite: raise FloatingPointError after a step that skipped a non-finite
            tile (default: the patch's ForgeConfig, False).
        accumulate: the micro-batches of each step (gradient accumulation: call ``step()``
            after the last one's backward): an int k (1: none, each backward steps), or True
            for as many as the loop that drives it says (GraphedStep's ``accumulation_steps``,
            the Trainer's ``gradient_accumulation_steps``); False is 1. Above 1 (or True) the
            fused layers hold their weight gradient over the backwards until ``step()``; how,
            the patch's ForgeConfig ``accumulation`` says. ``accumulation_steps`` is the count.
        max_grad_norm: clip the whole gradient, fused and ordinary parameters together, to this
            global norm before any weight moves, as ``torch.nn.utils.clip_grad_norm_`` does
            (0: no clipping). The fused layers then hold their gradient until ``step()`` too.

    Its param_groups own the hyperparameters: a scheduler that changes ``group["lr"]``
    changes what the fused layers read in their next backward.

    After each ``step()``: ``last_grad_norm`` (a 0-dim tensor) is the norm of this step's
    whole gradient, from the kernels' per-tile squared sums plus the ordinary gradients;
    ``pop_nonfinite_tiles()`` returns how many tiles were skipped for a non-finite
    gradient since it was last called (an ordinary parameter counts as one tile).
    """

    def __init__(self, model: nn.Module, lr: float | None = None, *, decay_parameter_names=None,
                 stop_on_nonfinite: bool | None = None, accumulate: bool | int = False, max_grad_norm: float = 0.0,
                 **hyperparameters):
        layers = fused_layers(model)
        if not layers:
            raise ValueError(
                f"{type(model).__name__} has no fused layers: call forge_hf.patch_model(model, "
                "optimizer=...) before creating a ForgeOptimizer"
            )
        if fsdp_needed(model):  # fully_shard ran after patch_model: fused layers step their shards
            enable_fsdp(model)
        _one(layers, "optimizer rule", lambda m: m.forge_rule.name)
        _one(layers, "rounding", lambda m: m.forge_config.rounding)
        if lr is not None:
            hyperparameters["lr"] = lr
        config = next(iter(layers.values())).forge_config  # the patch's options
        config = config.replace(hyperparameters={**config.hyperparameters, **hyperparameters})
        if stop_on_nonfinite is not None:
            config = config.replace(stop_on_nonfinite=stop_on_nonfinite)
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r}: give a number >= 0 (0: no clipping)")
        if not isinstance(accumulate, int) or (not isinstance(accumulate, bool) and accumulate < 1):
            raise ValueError(f"accumulate={accumulate!r}: give the micro-batches a step, an int >= 1, "
                             "or True (as many as the loop says)")
        defaults = config.group()
        rule = config.rule

        if decay_parameter_names is None:
            decay_parameter_names = default_decay_parameter_names(model)
        decay = set(decay_parameter_names)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": defaults["weight_decay"]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        super().__init__(groups, defaults)

        self.config = config
        self.rule = rule
        self.stop_on_nonfinite = config.stop_on_nonfinite
        self.stochastic = config.rounding == "stochastic"
        seed = config.seed
        by_weight = {m.weight: m for m in layers.values()}
        self._layers: dict[torch.Tensor, nn.Module] = {}  # fused weight -> its layer
        self._salt: dict[torch.Tensor, int] = {}
        for i, (_, p) in enumerate(named):
            if p in by_weight:
                layer = self._layers[p] = by_weight[p]
                self.state[p] = layer.forge_state
                self._salt[p] = layer_salt(layer.forge_config.seed, layer.forge_layer_index)
            else:
                self.state[p] = ForgeState(rule, config.state_precision_for(p.dtype))
                self._salt[p] = layer_salt(seed, -1 - i)  # apart from the fused layers' streams
        # DTensor parameters (FSDP2's row shards, tensor-parallel pieces): stepped through their local pieces
        self._shards = {p: shards for _, p in named if (shards := param_shards(p)) is not None}
        self._device = named[0][1].device
        # the fused layers' backend steps the non-fused tensors too, on a GPU without
        # whole-tensor PyTorch temporaries: the small 1-d ones (norms, biases) in one launch
        # (kernels/triton/multi_tensor.py), the others (embeddings, unfused layers) one launch each
        self._kernel = resolve_backend(config.backend, self._device) is not reference_fused_update
        self._nonfinite = torch.zeros((), device=self._device)
        self._launches: dict[torch.Tensor, tuple] = {}  # non-fused tensor -> (its layout, its BoundLaunch)
        self._batches: dict[tuple, MultiTensorRulePass] = {}  # batch_kind -> the one launch of its tensors
        # ForgeEmbeddings: stepped here from the rows their backward held (embedding_step.py)
        self._embeddings = EmbeddingSteps(model, self, config.fuse_embedding, rule, self.stochastic, self._kernel)
        self.last_grad_norm: torch.Tensor | None = None
        self._step_taken = False
        for group in self.param_groups:  # the one owner of the hyperparameters from now on
            for p in group["params"]:
                if p in self._layers:
                    self._layers[p].forge_group = group
        self.max_grad_norm = float(max_grad_norm)
        # the one count of micro-batches a step; LOOP_SAYS until a loop gives it (agree_accumulation)
        self.accumulation_steps = LOOP_SAYS if accumulate is True else int(accumulate) or 1
        # whether the fused layers hold their gradient until step() (accumulating or clipping), fixed here:
        # each one holds it from now on (held_gradient.py)
        self.holds_updates = self.accumulation_steps != 1 or self.max_grad_norm > 0
        self.held_adds = AddCounts()  # the bf16 buffers' one count of backwards (held_buffer.py), checkpointed
        for layer in self._layers.values():
            layer.forge_held = held_for(layer, config.accumulation, self.held_adds) if self.holds_updates else None

    @property
    def accumulate(self) -> bool | int:
        """The count as the constructor spells it: False (1), True (the loop's, not given yet) or k."""
        count = self.accumulation_steps
        return True if count == LOOP_SAYS else False if count == 1 else count

    def agree_accumulation(self, steps: int, setting: str = "accumulation_steps") -> str | None:
        """The one check of a loop that runs ``steps`` micro-batches a step (its ``setting``)
        and steps this optimizer after the last (GraphedStep, ForgeTrainer): why it cannot, or
        None. Built with ``accumulate=True``, the optimizer takes the first such loop's count."""
        if self.accumulation_steps == LOOP_SAYS:
            self.accumulation_steps = steps
        if steps == self.accumulation_steps:
            return None
        if self.accumulation_steps == 1:
            return (f"{setting}={steps}, but the ForgeOptimizer steps the fused layers in every backward: "
                    f"build it with ForgeOptimizer(model, ..., accumulate=True) or accumulate={steps}")
        return f"{setting}={steps}, but the ForgeOptimizer was built with accumulate={self.accumulate}"

    def params(self) -> list[torch.Tensor]:
        """Every parameter, in state_dict's numbering (param_groups' order)."""
        return [p for group in self.param_groups for p in group["params"]]

    # ------------------------------------------------------------------ step

    def skip_next_step(self) -> None:
        """This batch's step has already run (a replayed CUDA graph holds it): the next
        ``step()`` call, the Trainer's, returns without stepping."""
        self._step_taken = True

    @torch.no_grad()
    def step(self, closure=None):
        if self._step_taken:
            self._step_taken = False
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._embeddings.add_to_dense()
        settle_gradients([p for _, p in self._with_grads() if p in self._shards])
        unclipped = self._step_held()
        # [squared sum, bad tiles] of the fused layers: whole weights, and data-parallel
        # bands or tensor-parallel pieces (this rank's only, summed over the ranks of the
        # layer's own process groups: another group's ranks hold other replicas). A few
        # launches, not a few per layer.
        whole, bands = [], {}  # bands: ids of the groups -> (groups, stats)
        for layer in self._layers.values():
            # the step ends here: a gradient of the weight from now on belongs to the next one,
            # even where the module itself is not called in it (FusedWeightMixin.forge_on_gradient)
            layer.__dict__["_forge_updates"] = 0
            dp = layer.forge_dp
            if dp is not None:
                dp.wait()  # after step() every rank holds the whole updated weight
            groups = _norm_groups(layer)
            if groups:
                bands.setdefault(tuple(map(id, groups)), (groups, []))[1].append(layer.forge_stats)
            else:
                whole.append(layer.forge_stats)
        totals = torch.zeros(2, device=self._device)
        for groups, stats in [((), whole), *bands.values()]:
            if not stats:
                continue
            part = torch.stack([s if s.device == self._device else s.to(self._device) for s in stats]).sum(0)
            totals += all_reduce_over(part, groups)
            torch._foreach_zero_(stats)
        sq, bad = totals[0], totals[1]
        shard_totals = {}  # DTensor pieces: ids of groups -> (groups, [squared sum, skipped]) of this rank's
        pooled = {}  # device -> [squared sum, skipped] the kernel adds every whole tensor's into

        def pooled_on(device) -> torch.Tensor:
            stats = pooled.get(device)
            if stats is None:
                stats = pooled[device] = torch.zeros(2, device=device)
            return stats
        batches: dict[int, MultiTensorRulePass] = {}  # in launch order
        try:
            for group, p in self._with_grads():
                shards = self._shards.get(p)
                stats = None
                if self._kernel and shards is None:
                    stats = pooled_on(p.device)
                    if p not in self._layers and self._add_to_batch(p, group, batches):  # norms, biases
                        continue
                sums = self._step_tensor(p, group, stats)
                if sums is None:
                    continue  # added into the device's pooled stats, summed with the others below
                p_sq, p_bad = sums
                if shards is None or not shards.norm_groups:  # whole, or a replicated piece: alike on every rank
                    sq += p_sq.to(self._device)
                    bad += p_bad.to(self._device)
                else:
                    groups = shards.norm_groups
                    part = shard_totals.setdefault(tuple(map(id, groups)), (groups, torch.zeros(2)))[1]
                    part += torch.stack([p_sq.float().cpu(), p_bad.float().cpu()])
            for group, p in self._embeddings.pending(self.param_groups):
                stats = pooled_on(p.device) if self._kernel else None
                sums = self._embeddings.step(p, group, self.state[p], self._salt[p], stats)
                if sums is not None:
                    sq += sums[0].to(self._device)
                    bad += sums[1].to(self._device)
        finally:  # what was queued is stepped, as it would have been tensor by tensor
            for batch in batches.values():
                batch.launch(pooled[batch.device])
                release_held_args(batch.device)
        for stats in pooled.values():
            sq += stats[0].to(self._device)
            bad += stats[1].to(self._device)
        for groups, part in shard_totals.values():
            part = all_reduce_over(part.to(self._device), groups)
            sq += part[0]
            bad += part[1]
        self.last_grad_norm = sq.sqrt() if unclipped is None else unclipped
        self._nonfinite += bad
        if self.stop_on_nonfinite and bad.item() > 0:
            raise FloatingPointError(
                f"{int(bad.item())} gradient tile(s) were not finite in this step (skipped, not "
                "written) and stop_on_nonfinite=True stops training: lower the learning rate, "
                "check the data for bad values, or train in fp32/bf16 with a finite loss"
            )
        return loss

    def _step_held(self) -> torch.Tensor | None:
        """Step the fused layers from the gradients they held since the last step
        (held_gradient.py); with ``max_grad_norm``, first clip the whole gradient, held and
        ordinary, to it as ``torch.nn.utils.clip_grad_norm_`` does, and return its norm before
        clipping. The held steps' squared sums go into each layer's statistics, as a fused
        backward's do."""
        held = [(p, layer) for p, layer in self._layers.items()
                if layer.forge_held is not None and not layer.forge_held.empty]
        norm = scale = None
        joined: dict = {}  # inputs several layers hold, concatenated once for all of them
        if self.max_grad_norm > 0:
            norm = self._held_norm(held, joined)
            scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for _, p in self._with_grads():
                g = p.grad.to_local() if p in self._shards else p.grad  # a DTensor: its own piece
                g.mul_(scale.to(g.device))
            self._embeddings.scale(scale)
        for p, layer in held:  # a stash or a buffer alike: the layer knows which it holds
            layer.forge_step_held(functools.partial(self._step_gradient, p, layer.forge_group), scale, joined)
        return norm

    def _held_norm(self, held, joined: dict) -> torch.Tensor:
        """The norm of the whole gradient (what ``torch.nn.utils.clip_grad_norm_`` of one
        process would take): the held fused gradients and the ordinary ones. Parts that
        each rank holds only its rows of (sharded data parallelism's bands, FSDP2's shards,
        fused or not) are summed over their process group; whole ones (DDP's averages) are
        alike on every rank and count once."""
        sq = torch.zeros((), dtype=torch.float32, device=self._device)
        by_group = {}  # ids of groups -> [groups, this rank's squared sum of the pieces it holds]
        grams: dict = {}  # the last input's tokens x tokens product, for the layers after it that read it
        for _, layer in held:
            part = layer.forge_held.squared_norm(joined, grams).to(self._device)
            groups = _norm_groups(layer)
            if groups:
                by_group.setdefault(tuple(map(id, groups)), [groups, torch.zeros_like(sq)])[1] += part
            else:
                sq += part
        for _, p in self._with_grads():
            shards = self._shards.get(p)
            g = p.grad.to_local() if shards is not None else p.grad
            part = torch.linalg.vector_norm(g, dtype=torch.float32).square().to(self._device)
            if shards is not None and shards.norm_groups:
                groups = shards.norm_groups
                by_group.setdefault(tuple(map(id, groups)), [groups, torch.zeros_like(sq)])[1] += part
            else:
                sq += part
        sq += self._embeddings.squared_norm(self._device)  # whole on every rank (embedding_step.py)
        for groups, part in by_group.values():  # the same order on every rank: the model's
            sq += all_reduce_over(part, groups)
        return sq.sqrt()

    def held_snapshot(self) -> tuple:
        """What the fused layers hold, which gradient each parameter has and each state's
        counters and slots: a CUDA-graph capture that fails (it runs nothing, but its Python may
        have counted a step or made a slot before the failing op) goes back to it with
        ``held_restore``."""
        held = {layer: layer.forge_held.snapshot() for layer in self._layers.values() if layer.forge_held is not None}
        states = {s: (dict(s.host), list(s.slots), s.allocated) for s in self.state.values()}  # ForgeStates
        return held, {p: p.grad for p in self.params()}, self._embeddings.snapshot(), states

    def held_restore(self, snapshot: tuple) -> None:
        held, grads, rows, states = snapshot
        for forge_state, (host, slots, allocated) in states.items():
            forge_state.host, forge_state.slots, forge_state.allocated = host, slots, allocated
        self._embeddings.restore(rows)
        for layer, state in held.items():
            layer.forge_held.restore(state)
        for p, grad in grads.items():
            p.grad = grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._embeddings.clear()  # their compact rows are their gradients

    def _with_grads(self):
        """(group, parameter) for every parameter that holds a gradient, in param_groups' order."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield group, p

    # Elements per chunk of the non-fused step: bounds its fp32 and hash temporaries to a
    # few hundred MB, where a whole 0.5B-entry embedding would take tens of GB at once.
    CHUNK = 1 << 24

    def _step_tensor(self, p: torch.Tensor, group: dict, stats: torch.Tensor | None = None,
                     grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One rule step of ``p`` from ``p.grad`` (or ``grad``, in p's layout): (its squared
        sum, 1 if it was skipped), or with the kernel and ``stats``, None: those are added
        into ``stats``.

        A fused layer's weight (fusion switched off) is stepped in the kernels' (out, in)
        view with its layer's state, which may be 8-bit; other states are fp32 or bf16.
        Rows are stepped a chunk at a time; the arithmetic per element is unchanged."""
        grad = p.grad if grad is None else grad
        if grad.is_sparse:
            raise RuntimeError("sparse gradients are not supported by ForgeOptimizer: "
                               "use nn.Embedding(sparse=False)")
        state, layer = self.state[p], self._layers.get(p)
        transposed = layer.forge_transposed if layer is not None else None
        local, shards, row0 = p, self._shards.get(p), 0
        if shards is not None:  # a DTensor: this rank's piece; its first row's place in p picks the rounding bits
            local, row0 = p.to_local(), shards.rows(p.shape[0] if p.dim() else 1)[0]
            grad = grad.to_local() if isinstance(grad, DTensor) else grad  # a held buffer is this rank's already
        state.allocate(local, group, transposed=transposed, whole_rows=p.shape[0] if shards is not None else None)
        w, g = (local.t(), grad.t()) if transposed else (local, grad)
        # the step counts even when the gradient is skipped, as for a fused layer whose
        # tiles all are
        slots = state.kernel_slots()
        factored = [s for s in slots if isinstance(s, FactoredSlot)]
        if self._kernel:
            args = next_launch_args(self.rule, group, state, self._salt[p], local.device, row0)
            pair = self._step_with_kernel(p, w, g, slots, args, stats, sharded=shards is not None)
            self._reduce_columns(factored, state.step, shards)
            return None if stats is not None else (pair[0], pair[1])  # indexing a pair costs two ops
        scalars = self.rule.prepare(group, state.host)  # fp32 constants, as the kernels receive them
        consts = torch.tensor(scalars, dtype=torch.float32).to(local.device).unbind()
        ok = torch.isfinite(g).all()
        if any(isinstance(s, QuantisedSlot) for s in slots) and not ok:
            for s in factored:  # codes keep their values; a factored moment's sums must be carried
                s.carry(state.step, sharded=shards is not None)
            self._reduce_columns(factored, state.step, shards)
            return g.new_zeros((), dtype=torch.float32), g.new_ones((), dtype=torch.float32)  # codes cannot be masked
        # 1-d tensors as one row; an FSDP2 shard of one as a column (see _step_with_kernel)
        rows2d = w.shape[0] if w.dim() == 2 or shards is not None else 1
        as2d = (lambda t: t) if w.dim() == 2 else (lambda t: t.reshape(rows2d, -1))
        w2, g2 = as2d(w), as2d(g)
        plain = [as2d(s) if s is not None and not isinstance(s, QuantisedSlot) else s for s in slots]
        if w.dim() != 2 and not all(t is None or t.data_ptr() == u.data_ptr()
                                    for t, u in zip([w2, *plain], [w, *slots])):
            raise RuntimeError(f"a non-contiguous {tuple(p.shape)} parameter cannot be stepped in place: "
                               "make it contiguous before creating the ForgeOptimizer")
        n_cols = w2.shape[1]
        step_rows = max(1, self.CHUNK // max(n_cols, 1))
        sq = torch.zeros((), device=local.device)
        for r0 in range(0, rows2d, step_rows):
            rows = slice(r0, min(r0 + step_rows, rows2d))
            sq += reference_rule_rows(self.rule.name, w2, g2[rows].float(), plain, rows, consts, ok,
                                      self._salt[p], state.step, self.stochastic, row0)
        self._reduce_columns(factored, state.step, shards)
        return torch.where(ok, sq, 0.0), (~ok).float()

    @staticmethod
    def _reduce_columns(factored: list, step: int, shards) -> None:
        """A factored moment of a row-sharded weight (a fused layer's FSDP2 shard on the ordinary
        path): its column sums and total added over the ranks (factored.FactoredSlot.reduce_columns)."""
        if shards is not None and factored:
            reduce_factored_columns(factored, step, shards.group)

    def _step_gradient(self, p: torch.Tensor, group: dict, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p`` stepped from a whole gradient in p's layout (a fused layer's held buffer):
        (its squared sum, 1 if it was skipped)."""
        return self._step_tensor(p, group, grad=grad)

    def _add_to_batch(self, p: torch.Tensor, group: dict, batches: dict) -> bool:
        """Queue ``p``'s rule step in the launch of its batch_kind (one launch for all of
        them, after the loop), if it has one: then the step is taken and True returned."""
        grad, state = p.grad, self.state[p]
        if grad.layout != torch.strided:
            return False  # sparse: _step_tensor says why not
        state.allocate(p, group)
        kind = batch_kind(p, grad, state.slots)
        if kind is None:
            return False
        batch = self._batches.get(kind)
        if batch is None:
            batch = self._batches[kind] = MultiTensorRulePass(kind, self.rule.name, self.stochastic)
        args = next_launch_args(self.rule, group, state, self._salt[p], p.device, hold=True)
        batch.add(p, grad, state.slots, args)
        batches[id(batch)] = batch
        return True

    def _step_with_kernel(self, p, w, g, slots, args, stats=None, sharded=False):
        """The fused kernel's rule and store on an existing gradient, its sums added into
        ``stats`` (default: a new pair). A non-finite tile is skipped and counted tile by
        tile, as in a fused layer."""
        shape = None
        if w.dim() != 2:  # norms and biases: one row; an FSDP2 shard of one: a column, so that
            # the launch's first row (the shard's offset) gives each element its whole-tensor index
            if any(isinstance(s, QuantisedSlot) for s in slots) or not w.is_contiguous():
                raise RuntimeError(f"cannot step a {tuple(w.shape)} tensor in place: make it contiguous")
            shape = (-1, 1) if sharded else (1, -1)
            g = g.reshape(shape)
        if stats is None:
            stats = torch.zeros(2, dtype=torch.float32, device=w.device)
        self._launch_for(p, w, slots, shape)(g, g, args, stats)
        return stats

    def _launch_for(self, p, w, slots, shape) -> BoundLaunch:
        """``p``'s bound rule pass (kernels/launch/fused_update_launch.py) on ``w`` and its slots, viewed as
        ``shape`` if given, made again when the weight or a state slot moved (a load, an
        allocation, ``model.to``)."""
        key = (shape, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, *slots_key(slots))
        bound = self._launches.get(p)
        if bound is None or bound[0] != key:
            w = w.detach()
            if shape is not None:  # viewed once, not at every step: a view costs host time
                w, slots = w.view(shape), [None if s is None else s.view(shape) for s in slots]
            bound = self._launches[p] = (key, BoundLaunch(w, slots, self.rule.name, self.stochastic, grad_given=True))
        return bound[1]

    def pop_nonfinite_tiles(self) -> int:
        """Tiles skipped for a non-finite gradient since the last call."""
        count = int(self._nonfinite.item())
        self._nonfinite.zero_()
        return count

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        sd = super().state_dict()  # param_groups (hyperparameters) with torch's parameter indices
        sd["state"] = {i: self._full_state(p) for i, p in enumerate(self.params())
                       if self.state[p].allocated}
        sd[HELD_ADDS] = self.held_adds.value()
        return sd

    def _sharding(self, p):
        """How ``p``'s state is split over ranks: (its splitter: rows, gather_rows, shard_rows;
        p's number of rows), or (None, 0) when every rank holds it whole."""
        layer = self._layers.get(p)
        dp = layer.forge_dp if layer is not None else None
        if dp is not None and dp.mode == "sharded":
            return dp, layer.forge_weight_view().shape[0]
        if p in self._shards:  # FSDP2, fused or not
            return self._shards[p], p.shape[0]
        return None, 0

    def _local(self, p) -> torch.Tensor:
        """The part of ``p`` whose state this rank holds."""
        dp, n_rows = self._sharding(p)
        if dp is None:
            return p
        return p.to_local() if p in self._shards else p[slice(*dp.rows(n_rows))]

    def _full_state(self, p) -> dict:
        """A layer's state as one process holds it: data-parallel and FSDP2 row shards are
        gathered (every rank must call state_dict), so checkpoints load into any world size."""
        sd = self.state[p].state_dict()
        dp, n_rows = self._sharding(p)
        if dp is None:
            return sd
        whole = self.state[p].whole_keys  # a factored moment's column sums: whole on every rank
        return {k: dp.gather_rows(v, n_rows) if torch.is_tensor(v) and k not in whole else v for k, v in sd.items()}

    def _own_state(self, p, sd: dict) -> dict:
        dp, n_rows = self._sharding(p)
        if dp is None:
            return sd
        whole = self.state[p].whole_keys
        return {k: dp.shard_rows(v, n_rows) if torch.is_tensor(v) and k not in whole else v for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._load(state_dict, self._own_state)

    def load_local_state_dict(self, state_dict: dict) -> None:
        """As load_state_dict, with every state already this rank's rows (optim/fsdp.py's
        sharded checkpoints)."""
        self._load(state_dict, lambda p, sd: sd)

    def _load(self, state_dict: dict, own_rows) -> None:
        saved = state_dict.get("state", {})
        self.held_adds.restore(state_dict.get(HELD_ADDS, 0))  # absent: a checkpoint with no bf16 buffer's count
        states = self.state  # ForgeState objects, shared with the fused layers: keep them
        groups = self.param_groups  # the dicts the fused layers read: keep them too
        super().load_state_dict({**state_dict, "state": {}})  # checks and restores param_groups
        for group, loaded in zip(groups, self.param_groups):
            group.clear()
            group.update(loaded)
        self.param_groups = groups
        self.state = states
        for i, p in enumerate(self.params()):
            state = self.state[p]
            if i in saved:
                dp, _ = self._sharding(p)  # a factored moment's row shards: their columns summed over dp's ranks
                factored = dp is not None and state.stored_precision == "log4_factored"
                state.load_state_dict(own_rows(p, saved[i]), self._local(p), group=dp.group if factored else None)
            else:
                state.reset()  # nothing saved: start fresh
