"""patch_model / unpatch_model: fuse every eligible linear layer of a model and report it.

Eligible: ``nn.Linear`` and transformers' ``Conv1D`` whose weight trains, belongs to that
module alone and is read only through it. Everything else stays an ordinary parameter for
an ordinary optimizer (ForgeOptimizer steps both kinds). This file is the static half of
the safety rules; the runtime half (a module called twice in a step, a weight read
elsewhere, a gradient that materialises anyway) is in nn/linear.py (FusedWeightMixin).

A runtime fallback shows in the report, which reads the layers of the model it patched
(held weakly) whenever it is printed or summarised, and at ``update_fallbacks``.

``include`` / ``exclude`` patterns are fnmatch globs (``*``, ``?``, ``[..]``) matched against
whole dot-separated parts of a module's name: ``"lm_head"``, ``"q_proj"`` (every q_proj),
``"lora_A"``, ``"layers.0"`` (everything in layer 0), ``"model.layers.*.mlp.*"``.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from ..core.config import TRAINER, ForgeConfig, resolve_config, trainer_keys
from ..nn.conv1d import ForgeConv1D
from ..nn.linear import WEIGHT_DTYPES, ForgeLinear, FusedWeightMixin
from . import tensor_parallel
from .embedding_patch import EmbeddingEntry, apply_embeddings, plan_embeddings, release_embeddings
from .memory_budget import BudgetRow, budget_table, memory_budget

# Skip reasons (PatchReport.skipped[i].reason); each skipped tensor is stepped by the
# ordinary optimizer.
FROZEN = "frozen"                  # weight does not require grad (PEFT base layers)
TIED = "tied"                      # same Parameter as an input embedding (tie_word_embeddings)
SHARED = "shared"                  # same Parameter in more than one module (or module registered twice)
EXPERT_TENSOR = "expert_tensor"    # 3-D MoE expert weights: not a linear module
LIGER_LM_HEAD = "liger_lm_head"    # Liger's fused linear cross-entropy reads lm_head.weight itself
TRL_LM_HEAD = "trl_lm_head"        # TRL's fused LM head (chunked log-probs) reads lm_head.weight itself
ADAPTER = "adapter"                # a PEFT adapter linear while min_params > 0 (DEFAULT_MIN_PARAMS)
EXCLUDED = "excluded"              # matches an exclude pattern
NOT_INCLUDED = "not_included"      # include was given and matches it not
BELOW_MIN_PARAMS = "below_min_params"
FLOAT16 = "float16"                # a float16 weight: fused steps need fp32 or bf16 (FLOAT16_FIX)
UNSUPPORTED = "unsupported"        # a subclass with its own forward, a float64 weight, ...
TENSOR_PARALLEL = "tensor_parallel"  # a DTensor weight whose local dY^T X is not its piece's gradient (replicated, ...)
FELL_BACK = "fell_back"            # fused, on the ordinary path in its last step or for good (PatchReport.fell_back)

# why float16 weights are not fused, and what to load instead
FLOAT16_FIX = ("fused steps need float32 or bfloat16 weights, as float16 training needs a gradient scaler, which a "
               "fused step cannot use: load the model in bfloat16, or in float32 and train with bf16=True "
               "(autocast)")

PLAIN_TYPES = (nn.Linear, Conv1D)
FUSED_TYPES = {nn.Linear: ForgeLinear, Conv1D: ForgeConv1D}

# Subclasses whose own forward is exactly their parent's map, read in transformers 5.24
# (an AST walk over models/*/modeling_*.py for nn.Linear / Conv1D subclasses). Each is
# trained against an unpatched twin in tests/optim/test_patch_models.py. Subclasses that do not
# override forward at all (EsmFoldLinear: only its initialisation differs) need no entry.
LINEAR_MAP_SUBCLASSES = {
    "transformers.models.falcon.modeling_falcon.FalconLinear": nn.Linear,  # input @ weight.T (+ bias)
}

# Modules that replace a model's forward and read its output head's weight directly:
# the defining package's name -> (skip reason, detail).
HEAD_READERS = {
    "liger_kernel": (LIGER_LM_HEAD, "Liger's fused linear cross-entropy reads its weight and computes its gradient"),
    "trl": (TRL_LM_HEAD, "TRL's fused LM head reads its weight and computes its gradient (the trainers' "
                         "chunked log-probs, which never build the logits)"),
}


@dataclass(frozen=True)
class FusedModule:
    name: str
    kind: str  # "Linear" or "Conv1D"
    shape: tuple[int, int]  # (out_features, in_features)
    params: int
    gradient_bytes: int  # the weight gradient that is never allocated
    layer_index: int  # its stochastic-rounding stream
    state_precision: str  # what its states are stored in (state_precision="auto" resolved)
    weight_dtype: str  # "bfloat16" or "float32"


@dataclass(frozen=True)
class Skipped:
    name: str
    kind: str  # "Linear", "Conv1D" or "parameter"
    shape: tuple[int, ...]
    reason: str  # one of the reason constants above
    detail: str


@dataclass
class PatchReport:
    """What patch_model did: ``print(report)`` shows it as a table. ``fused`` and
    ``fell_back`` follow the layers of the model (held weakly) when the report is printed or
    summarised, and at ``update_fallbacks``."""

    config: ForgeConfig
    fused: list[FusedModule] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    fell_back: list[Skipped] = field(default_factory=list)  # reason FELL_BACK, detail: the layer's reason
    embeddings: list[EmbeddingEntry] = field(default_factory=list)  # the input embedding (fuse_embedding)
    _model: weakref.ref | None = field(default=None, repr=False, compare=False)  # the patched model, weakly
    # the fused modules now in fell_back, by name: a layer that fuses again returns to fused
    _unfused: dict[str, FusedModule] = field(default_factory=dict, repr=False, compare=False)

    @property
    def fused_params(self) -> int:
        return sum(m.params for m in self.fused)

    @property
    def gradient_bytes_saved(self) -> int:
        return sum(m.gradient_bytes for m in self.fused)

    @property
    def fused_names(self) -> list[str]:
        return [m.name for m in self.fused]

    def skip_reasons(self) -> dict[str, str]:
        """Skipped name -> reason."""
        return {s.name: s.reason for s in self.skipped}

    def update_fallbacks(self, model: nn.Module | None = None) -> list[Skipped]:
        """Bring ``fused`` and ``fell_back`` up to date with the layers of ``model`` (default:
        the model patch_model was given): a layer on the ordinary path, for good or in its
        last step (FusedWeightMixin.forge_fall_back), is in ``fell_back`` with its reason;
        one that fuses again is back in ``fused``. Returns the entries new in ``fell_back``."""
        if model is None:
            model = self._model() if self._model is not None else None
            if model is None:
                return []
        modules = dict(model.named_modules())
        order = {name: i for i, name in enumerate(modules)}
        every = sorted([*self.fused, *self._unfused.values()], key=lambda m: order.get(m.name, len(order)))
        before = {s.name for s in self.fell_back}
        self.fused, self.fell_back, self._unfused = [], [], {}
        for m in every:
            layer = modules.get(m.name)
            reason = layer.forge_fallback() if isinstance(layer, FusedWeightMixin) else None
            if reason is None:
                self.fused.append(m)
                continue
            when = "for good" if not layer.forge_enabled else "last step; it fuses again once the cause is gone"
            self._unfused[m.name] = m
            self.fell_back.append(Skipped(m.name, m.kind, m.shape, FELL_BACK, f"{reason} ({when})"))
        return [s for s in self.fell_back if s.name not in before]

    def summary(self) -> str:
        """The first line of ``str(report)``."""
        self.update_fallbacks()
        fell_back = f", {len(self.fell_back)} fell back" if self.fell_back else ""
        return (f"forge patch: {len(self.fused)} modules fused ({self.fused_params:,} parameters, "
                f"{_size(self.gradient_bytes_saved)} of gradients never allocated){fell_back}, "
                f"{len(self.skipped)} skipped; optimizer={self.config.optimizer}, "
                f"state_precision={self.state_precision_summary()}, rounding={self.config.rounding}")

    def state_precision_summary(self) -> str:
        """The fused layers' state precision, and under auto why: 'bf16 (auto: bf16 weights)'."""
        option = self.config.state_precision
        if option != "auto":
            return option
        picked = sorted({(m.state_precision, m.weight_dtype) for m in self.fused})
        if not picked:
            return "auto"
        reasons = ", ".join(f"{precision} for {dtype} weights" for precision, dtype in picked)
        return f"{picked[0][0]} (auto: {picked[0][1]} weights)" if len(picked) == 1 else f"auto: {reasons}"

    def __str__(self) -> str:
        parts = [self.summary()]  # brings fused and fell_back up to date
        fused = [(m.name, m.kind, " x ".join(map(str, m.shape)), f"{m.params:,}") for m in self.fused]
        if fused:
            parts.append(_table(("fused", "kind", "shape (out x in)", "params"), fused))
        for title, entries in (("fell back", self.fell_back), ("skipped", self.skipped)):
            rows = [(s.name, s.kind, " x ".join(map(str, s.shape)), f"{s.reason}: {s.detail}") for s in entries]
            if rows:
                parts.append(_table((title, "kind", "shape", "reason"), rows))
        if self.embeddings:
            parts.append("\n".join(self._embedding_line(e) for e in self.embeddings))
        budget = self.memory()
        if budget:
            parts.append(_table(("memory between steps", "params", "GiB", "B/param", "note"), budget_table(budget)))
        return "\n\n".join(parts)

    def memory(self) -> list[BudgetRow]:
        """What the patched model keeps on its device between steps (memory_budget.py), by
        part, with bytes a parameter; [] once the model is gone."""
        model = self._model() if self._model is not None else None
        if model is None:
            return []
        compact = {e.name for e in self.embeddings if e.reason_now(model) is None}
        return memory_budget(model, self.config, compact)

    def _embedding_line(self, entry: EmbeddingEntry) -> str:
        shape = " x ".join(map(str, entry.shape))
        reason = entry.reason_now(self._model() if self._model is not None else None)
        if reason is None:
            return (f"embedding {entry.name} ({shape}): stepped from the rows each batch touches, its "
                    f"{_size(entry.gradient_bytes)} dense gradient never allocated (fuse_embedding); "
                    f"states {entry.precisions[0]}")
        return f"embedding {entry.name} ({shape}): ordinary path: {reason}; states {entry.precisions[1]}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in (header, *rows)]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- patterns


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches a run of whole dot-separated parts of ``name``."""
    return any(fnmatchcase(name, p) for p in (pattern, f"*.{pattern}", f"{pattern}.*", f"*.{pattern}.*"))


def _first_match(name: str, patterns: list[str]) -> str | None:
    return next((p for p in patterns if _matches(name, p)), None)


def _check_patterns(patterns: tuple[str, ...], what: str, names: list[str], model: nn.Module) -> None:
    for p in patterns:
        if not any(_matches(n, p) for n in names):
            examples = ", ".join(repr(n) for n in names[:3]) or "none"
            raise ValueError(
                f"{what} pattern {p!r} matches no linear module of {type(model).__name__} (its "
                f"linear modules are named like {examples}): fix the pattern or drop it; patterns "
                "are fnmatch globs over whole dot-separated name parts, e.g. 'q_proj' or 'layers.0'"
            )


# ----------------------------------------------------------------------------- model facts


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> every (qualified name, module) holding it, duplicates included."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((f"{mname}.{pname}" if mname else pname, module))
    return owners


def _defined_in(function) -> str:
    """The module whose code ``function`` is: functools.wraps copies the wrapped
    function's ``__module__`` (TRL's fused head wraps the model's own forward)."""
    function = getattr(function, "__func__", function)
    return str(getattr(function, "__globals__", {}).get("__name__") or getattr(function, "__module__", ""))


def _read_heads(model: nn.Module) -> dict[int, tuple[str, str]]:
    """id(linear) -> (reason, detail) for the linears inside output heads whose model
    forward was replaced by one that reads the head's weight and computes its gradient
    without calling the module (HEAD_READERS)."""
    heads: dict[int, tuple[str, str]] = {}
    for module in model.modules():
        package = _defined_in(module.__dict__.get("forward", type(module).forward)).partition(".")[0]
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if package in HEAD_READERS and head is not None:
            heads.update((id(m), HEAD_READERS[package]) for m in head.modules() if isinstance(m, nn.Linear))
    return heads


def _adapters(model: nn.Module) -> set[int]:
    """ids of the linears inside PEFT tuner layers' adapter containers (``lora_A``,
    ``lora_B``, ...: each tuner layer names them in ``adapter_layer_names``). Trained full
    copies (``modules_to_save``: not a tuner layer) are not adapters."""
    if "peft" not in sys.modules:  # a model with adapters has imported it
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: set[int] = set()
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in module.adapter_layer_names:
            container = getattr(module, attr, None)
            if isinstance(container, nn.Module):
                found.update(id(m) for m in container.modules() if isinstance(m, PLAIN_TYPES))
    return found


def _kind(module: nn.Module) -> str:
    return "Conv1D" if isinstance(module, Conv1D) else "Linear"


def _out_in(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    return (w.shape[1], w.shape[0]) if isinstance(module, Conv1D) else tuple(w.shape)


def _plain_type(module: nn.Module) -> type | None:
    """nn.Linear or Conv1D when ``module`` computes exactly its map: one of them, its fused
    twin, a subclass that keeps its forward, or one of LINEAR_MAP_SUBCLASSES."""
    cls = type(module)
    for plain, fused in FUSED_TYPES.items():
        if cls in (plain, fused):
            return plain
        if issubclass(cls, plain) and (cls.forward is plain.forward
                                       or f"{cls.__module__}.{cls.__qualname__}" in LINEAR_MAP_SUBCLASSES):
            return plain
    return None


def _skip_reason(name, module, *, include, exclude, owners, embeddings, read_heads, adapters, min_params):
    """(reason, detail) when ``module`` must not be fused, else None."""
    if include and _first_match(name, include) is None:
        return NOT_INCLUDED, f"matches no include pattern {list(include)}"
    pattern = _first_match(name, exclude)
    if pattern is not None:
        return EXCLUDED, f"matches exclude pattern {pattern!r}"
    w = module.weight
    if not w.requires_grad:
        return FROZEN, "weight does not require grad"
    others = [n for n, m in owners[id(w)] if m is not module]
    if len(owners[id(w)]) - len(others) > 1:
        return SHARED, "the module is registered under more than one name"
    if others and id(w) in embeddings:
        return TIED, f"weight tied to the input embedding {embeddings[id(w)]}"
    if others:
        return SHARED, f"weight also belongs to {', '.join(others)}"
    if id(module) in read_heads:
        return read_heads[id(module)]
    if _plain_type(module) is None:
        return UNSUPPORTED, (f"{type(module).__name__} is a subclass with its own forward; only nn.Linear / "
                             "Conv1D and the subclasses known to compute their plain map are fused")
    if isinstance(w, DTensor):  # tensor parallel: the fused step needs a piece it can step from its local tensors
        detail = tensor_parallel.skip_detail(module)
        if detail is not None:
            return TENSOR_PARALLEL, detail
    elif "forward" in module.__dict__:
        return UNSUPPORTED, "forward is replaced on the instance (an accelerate/offload hook?)"
    if parametrize.is_parametrized(module):
        return UNSUPPORTED, "the weight is parametrized"
    if w.dtype == torch.float16:
        return FLOAT16, FLOAT16_FIX
    if w.dtype not in WEIGHT_DTYPES:
        return UNSUPPORTED, f"weight dtype {w.dtype} is not supported: use float32 (autocast) or bfloat16 weights"
    if min_params and id(module) in adapters:
        return ADAPTER, (f"a PEFT adapter (rank {min(w.shape)}): its small gradient is formed after the step's "
                         "memory peak, and the ordinary step is faster; min_params=0 fuses it")
    if w.numel() < min_params:
        return BELOW_MIN_PARAMS, f"{w.numel():,} weights < min_params={min_params:,}"
    return None


def _expert_tensors(model: nn.Module) -> list[Skipped]:
    """Trainable 3-D parameters of expert modules: MoE experts stored as one tensor
    (transformers 5's Qwen3MoeExperts, MixtralExperts, ...)."""
    found = []
    for mname, module in model.named_modules():
        if "expert" not in f"{mname}.{type(module).__name__}".lower():
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.dim() == 3:
                found.append(Skipped(f"{mname}.{pname}", "parameter", tuple(p.shape), EXPERT_TENSOR,
                                     "3-D expert tensor, not a linear module"))
    return found


def _set_child(model: nn.Module, name: str, child: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    model.get_submodule(parent)._modules[attr] = child


def _release(layer: nn.Module) -> nn.Module:
    """The plain module back, of the class it had before patching (FalconLinear, ...)."""
    plain_class = layer.__dict__.get("forge_plain_class")
    if plain_class is not None:
        plain = layer.forge_release(plain_class)
    else:
        plain = layer.to_conv1d() if isinstance(layer, ForgeConv1D) else layer.to_linear()
    tensor_parallel.release(layer, plain)
    return plain


# ----------------------------------------------------------------------------- public API


def patch_model(model: nn.Module, config: ForgeConfig | None = None, **options) -> PatchReport:
    """Replace every eligible linear of ``model`` by its fused twin (same Parameter objects).

    Args:
        model: the model to patch in place (any ``nn.Module`` holding ``nn.Linear`` or
            transformers ``Conv1D`` modules).
        config: a ForgeConfig; default: every option's default.
        **options: ForgeConfig options applied over ``config``: ``optimizer`` (the rule,
            default "adamw"), ``state_precision``, ``rounding``, ``backend``, ``seed``,
            ``include`` / ``exclude`` (a module-name pattern or a list of them, see the
            module docstring; with ``include`` only matching modules are considered),
            ``min_params`` (smaller weights, and PEFT adapters, stay on the ordinary
            optimizer; 0 fuses them all), and the rule's hyperparameters (``lr``,
            ``betas``, ``weight_decay``, ...), which a ForgeOptimizer built later takes as
            its defaults.

    Returns:
        A PatchReport: what was fused and what was skipped, with each reason.

    Layers get consecutive ``layer_index`` values, so their stochastic-rounding streams
    differ. Patching again keeps already-fused modules with their state (it refuses a
    different optimizer, state_precision or rounding: unpatch_model first); one that the new
    arguments skip is restored to a plain module. Nothing changes when an argument is bad.
    """
    keys = trainer_keys()
    trainer_only = sorted(k for k in options if k in keys and keys[k].metadata["used_by"] == TRAINER)
    if trainer_only:
        raise TypeError(
            f"patch_model does not take {trainer_only}: ForgeTrainer acts on them (optim_args). In your own "
            "loop call forge_hf.recompute_swiglu(model), forge_hf.enable_data_parallel(model, mode=...), "
            "forge_hf.GraphedStep or forge_hf.causal_lm_loss yourself")
    config = resolve_config(config, options)
    if isinstance(model, PLAIN_TYPES):
        raise TypeError(f"patch_model walks a model's submodules, got a bare {type(model).__name__}: "
                        "use ForgeLinear.from_linear / ForgeConv1D.from_conv1d for a single layer")
    include, exclude, min_params = config.include, config.exclude, config.min_params
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, PLAIN_TYPES)]
    names = [n for n, _ in linears]
    _check_patterns(include, "include", names, model)
    _check_patterns(exclude, "exclude", names, model)

    facts = dict(include=include, exclude=exclude, owners=_owners(model), read_heads=_read_heads(model),
                 adapters=_adapters(model), min_params=min_params,
                 embeddings={id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)})
    decisions = [(n, m, _skip_reason(n, m, **facts)) for n, m in linears]
    embedding_plan = plan_embeddings(model, config, facts["owners"])  # raises before anything changes

    for name, module, skip in decisions:
        if isinstance(module, FusedWeightMixin) and skip is None:
            wanted = (config.optimizer, config.state_precision_for(module.weight.dtype), config.rounding)
            have = (module.forge_rule.name, module.forge_state.precision, module.forge_config.rounding)
            if have != wanted:
                raise ValueError(
                    f"{name} is already fused with optimizer, state_precision, rounding = {have}, "
                    f"not {wanted}: call forge_hf.unpatch_model(model) first to patch it anew"
                )

    report = PatchReport(config, _model=weakref.ref(model))
    next_index = 1 + max((m.forge_layer_index for _, m, _ in decisions if isinstance(m, FusedWeightMixin)),
                         default=-1)
    for name, module, skip in decisions:
        if skip is not None:
            if isinstance(module, FusedWeightMixin):
                if module.forge_state.step:
                    warnings.warn(f"{name} is no longer fused ({skip[0]}): its fused optimizer state is dropped",
                                  stacklevel=2)
                _set_child(model, name, _release(module))
            report.skipped.append(Skipped(name, _kind(module), _out_in(module), *skip))
            continue
        if not isinstance(module, FusedWeightMixin):
            plain = _plain_type(module)
            original = type(module)
            module = FUSED_TYPES[plain].forge_adopt(module, config, layer_index=next_index)
            module.forge_name = name
            if original is not plain:
                module.forge_plain_class = original  # unpatch_model restores it
            next_index += 1
            _set_child(model, name, module)
        tensor_parallel.attach(module)
        w = module.weight
        report.fused.append(FusedModule(name, _kind(module), _out_in(module), w.numel(),
                                        w.numel() * w.element_size(), module.forge_layer_index,
                                        module.forge_state.precision, str(w.dtype).removeprefix("torch.")))
    report.skipped.extend(_expert_tensors(model))
    report.embeddings = apply_embeddings(embedding_plan, config)

    if not report.fused:
        warnings.warn(f"patch_model fused no module of {type(model).__name__}{_nothing_fused_hint(report)}: "
                      f"skipped {_reason_counts(report)}; print the returned report for each module's reason",
                      stacklevel=2)
    return report


def _reason_counts(report: PatchReport) -> str:
    counts = Counter(s.reason for s in report.skipped)
    return ", ".join(f"{n} {reason}" for reason, n in counts.most_common()) or "nothing"


def _nothing_fused_hint(report: PatchReport) -> str:
    reasons = {s.reason for s in report.skipped}
    if FLOAT16 in reasons:
        return (" (its float16 weights are not fused, as float16 training needs a gradient scaler: load the model in "
                "bfloat16, or in float32 and train with bf16=True)")
    if ADAPTER in reasons:
        return " (pass min_params=0 to fuse small layers and PEFT adapters)"
    return " (pass min_params=0 to fuse small layers)" if BELOW_MIN_PARAMS in reasons else ""


def unpatch_model(model: nn.Module) -> list[str]:
    """Restore every fused module to a plain nn.Linear / Conv1D with the same Parameter
    objects and hooks (fused optimizer state is dropped). Returns the restored names."""
    restored = []
    for name, parent in list(model.named_modules()):
        for attr, child in list(parent._modules.items()):
            if isinstance(child, FusedWeightMixin):
                parent._modules[attr] = _release(child)
                restored.append(f"{name}.{attr}" if name else attr)
    return restored + release_embeddings(model)
