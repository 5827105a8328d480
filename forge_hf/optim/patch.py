"""patch_model / unpatch_model: fuse every eligible linear layer of a model and report it.

Eligible: ``nn.Linear`` and transformers' ``Conv1D`` whose weight trains, belongs to that
module alone and is read only through it. Everything else stays an ordinary parameter for
an ordinary optimizer (ForgeOptimizer steps both kinds). This file is the static half of
the safety rules; the runtime half (a module called twice in a step, a weight read
elsewhere, a gradient that materialises anyway) is in nn/linear.py (FusedWeightMixin).

``include`` / ``exclude`` patterns are fnmatch globs (``*``, ``?``, ``[..]``) matched against
whole dot-separated parts of a module's name: ``"lm_head"``, ``"q_proj"`` (every q_proj),
``"lora_A"``, ``"layers.0"`` (everything in layer 0), ``"model.layers.*.mlp.*"``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from ..core.rules import get_rule, make_group
from ..core.state import check_rounding, check_state_precision
from ..kernels.dispatch import BACKENDS
from ..nn.conv1d import ForgeConv1D
from ..nn.linear import WEIGHT_DTYPES, ForgeLinear, FusedWeightMixin

# Below 64K weights (four 128x128 tiles) a fused launch cannot fill a GPU and saves under
# 256 KiB of gradient; a torch optimizer steps such tensors in one batched launch. LoRA
# adapters of rank <= 8 on a 4096 model fall below; pass min_params=0 to fuse them anyway.
DEFAULT_MIN_PARAMS = 1 << 16

# Skip reasons (PatchReport.skipped[i].reason); each skipped tensor is stepped by the
# ordinary optimizer.
FROZEN = "frozen"                  # weight does not require grad (PEFT base layers)
TIED = "tied"                      # same Parameter as an input embedding (tie_word_embeddings)
SHARED = "shared"                  # same Parameter in more than one module (or module registered twice)
EXPERT_TENSOR = "expert_tensor"    # 3-D MoE expert weights: not a linear module
LIGER_LM_HEAD = "liger_lm_head"    # Liger's fused linear cross-entropy reads lm_head.weight itself
EXCLUDED = "excluded"              # matches an exclude pattern
NOT_INCLUDED = "not_included"      # include was given and matches it not
BELOW_MIN_PARAMS = "below_min_params"
UNSUPPORTED = "unsupported"        # a subclass with its own forward, fp16 weight, ...

PLAIN_TYPES = (nn.Linear, Conv1D)
FUSED_TYPES = {nn.Linear: ForgeLinear, Conv1D: ForgeConv1D}


@dataclass(frozen=True)
class FusedModule:
    name: str
    kind: str  # "Linear" or "Conv1D"
    shape: tuple[int, int]  # (out_features, in_features)
    params: int
    gradient_bytes: int  # the weight gradient that is never allocated
    layer_index: int  # its stochastic-rounding stream


@dataclass(frozen=True)
class Skipped:
    name: str
    kind: str  # "Linear", "Conv1D" or "parameter"
    shape: tuple[int, ...]
    reason: str  # one of the reason constants above
    detail: str


@dataclass
class PatchReport:
    """What patch_model did: ``print(report)`` shows it as a table."""

    optimizer: str
    state_precision: str
    rounding: str
    fused: list[FusedModule] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

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

    def __str__(self) -> str:
        head = (f"forge patch: {len(self.fused)} modules fused ({self.fused_params:,} parameters, "
                f"{_size(self.gradient_bytes_saved)} of gradients never allocated), "
                f"{len(self.skipped)} skipped; optimizer={self.optimizer}, "
                f"state_precision={self.state_precision}, rounding={self.rounding}")
        fused = [(m.name, m.kind, " x ".join(map(str, m.shape)), f"{m.params:,}") for m in self.fused]
        skipped = [(s.name, s.kind, " x ".join(map(str, s.shape)), f"{s.reason}: {s.detail}")
                   for s in self.skipped]
        parts = [head]
        if fused:
            parts.append(_table(("fused", "kind", "shape (out x in)", "params"), fused))
        if skipped:
            parts.append(_table(("skipped", "kind", "shape", "reason"), skipped))
        return "\n\n".join(parts)


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


def _pattern_list(patterns, what: str) -> list[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    patterns = list(patterns)
    if not all(isinstance(p, str) and p for p in patterns):
        raise TypeError(f"{what}={patterns!r}: give module-name patterns as non-empty strings")
    return patterns


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches a run of whole dot-separated parts of ``name``."""
    return any(fnmatchcase(name, p) for p in (pattern, f"*.{pattern}", f"{pattern}.*", f"*.{pattern}.*"))


def _first_match(name: str, patterns: list[str]) -> str | None:
    return next((p for p in patterns if _matches(name, p)), None)


def _check_patterns(patterns: list[str], what: str, names: list[str], model: nn.Module) -> None:
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


def _liger_heads(model: nn.Module) -> set[int]:
    """ids of the linears inside output heads whose model forward is Liger's fused linear
    cross-entropy (it reads lm_head.weight and computes its gradient without the module)."""
    heads: set[int] = set()
    for module in model.modules():
        forward = module.__dict__.get("forward", type(module).forward)
        if not str(getattr(forward, "__module__", "")).startswith("liger_kernel"):
            continue
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if head is not None:
            heads.update(id(m) for m in head.modules() if isinstance(m, nn.Linear))
    return heads


def _kind(module: nn.Module) -> str:
    return "Conv1D" if isinstance(module, Conv1D) else "Linear"


def _out_in(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    return (w.shape[1], w.shape[0]) if isinstance(module, Conv1D) else tuple(w.shape)


def _plain_type(module: nn.Module) -> type | None:
    """nn.Linear or Conv1D when ``module`` is exactly one (or its fused twin)."""
    for plain, fused in FUSED_TYPES.items():
        if type(module) in (plain, fused):
            return plain
    return None


def _skip_reason(name, module, *, include, exclude, owners, embeddings, liger_heads, min_params):
    """(reason, detail) when ``module`` must not be fused, else None."""
    if include and _first_match(name, include) is None:
        return NOT_INCLUDED, f"matches no include pattern {include}"
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
    if id(module) in liger_heads:
        return LIGER_LM_HEAD, "Liger's fused linear cross-entropy reads its weight and computes its gradient"
    if _plain_type(module) is None:
        return UNSUPPORTED, (f"{type(module).__name__} is a subclass with its own forward; only exact "
                             "nn.Linear / Conv1D are fused")
    if "forward" in module.__dict__:
        return UNSUPPORTED, "forward is replaced on the instance (an accelerate/offload hook?)"
    if parametrize.is_parametrized(module):
        return UNSUPPORTED, "the weight is parametrized"
    if w.dtype not in WEIGHT_DTYPES:
        return UNSUPPORTED, f"weight dtype {w.dtype} is not supported: use float32 (autocast) or bfloat16 weights"
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
    return layer.to_conv1d() if isinstance(layer, ForgeConv1D) else layer.to_linear()


# ----------------------------------------------------------------------------- public API


def patch_model(model: nn.Module, optimizer: str = "adamw", state_precision: str = "fp32",
                rounding: str = "stochastic", include=None, exclude=None, seed: int = 0,
                backend: str = "auto", min_params: int = DEFAULT_MIN_PARAMS,
                **hyperparameters) -> PatchReport:
    """Replace every eligible linear of ``model`` by its fused twin (same Parameter objects).

    ``include`` / ``exclude``: a pattern or a list of them (module docstring); with
    ``include`` only matching modules are considered. ``min_params``: smaller weights stay
    on the ordinary optimizer. ``hyperparameters`` (lr, betas, ...) as in
    ``ForgeLinear.from_linear``. Layers get consecutive ``layer_index`` values, so their
    stochastic-rounding streams differ.

    Patching again keeps already-fused modules with their state (it refuses a different
    optimizer, state_precision or rounding: unpatch_model first); one that the new
    arguments skip is restored to a plain module.
    """
    rule = get_rule(optimizer)
    make_group(rule, hyperparameters)  # bad hyperparameters fail before anything changes
    check_state_precision(state_precision)
    check_rounding(rounding)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend={backend!r}: choose one of {list(BACKENDS)}")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 0:
        raise ValueError(f"min_params={min_params!r} is not a count: use an integer >= 0 "
                         "(0 fuses every eligible linear)")
    if isinstance(model, PLAIN_TYPES):
        raise TypeError(f"patch_model walks a model's submodules, got a bare {type(model).__name__}: "
                        "use ForgeLinear.from_linear / ForgeConv1D.from_conv1d for a single layer")
    include, exclude = _pattern_list(include, "include"), _pattern_list(exclude, "exclude")
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, PLAIN_TYPES)]
    names = [n for n, _ in linears]
    _check_patterns(include, "include", names, model)
    _check_patterns(exclude, "exclude", names, model)

    facts = dict(include=include, exclude=exclude, owners=_owners(model), liger_heads=_liger_heads(model),
                 embeddings={id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)},
                 min_params=min_params)
    decisions = [(n, m, _skip_reason(n, m, **facts)) for n, m in linears]

    wanted = (rule.name, state_precision, rounding)
    for name, module, skip in decisions:
        if isinstance(module, FusedWeightMixin) and skip is None:
            have = (module.forge_rule.name, module.forge_state.precision, module.forge_rounding)
            if have != wanted:
                raise ValueError(
                    f"{name} is already fused with optimizer, state_precision, rounding = {have}, "
                    f"not {wanted}: call forge_hf.unpatch_model(model) first to patch it anew"
                )

    report = PatchReport(rule.name, state_precision, rounding)
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
            fused_cls = FUSED_TYPES[_plain_type(module)]
            module = fused_cls.forge_adopt(module, optimizer=rule.name, state_precision=state_precision,
                                           rounding=rounding, seed=seed, layer_index=next_index,
                                           backend=backend, **hyperparameters)
            module.forge_name = name
            next_index += 1
            _set_child(model, name, module)
        w = module.weight
        report.fused.append(FusedModule(name, _kind(module), _out_in(module), w.numel(),
                                        w.numel() * w.element_size(), module.forge_layer_index))
    report.skipped.extend(_expert_tensors(model))

    if not report.fused:
        hint = " (pass min_params=0 to fuse small layers)" if any(
            s.reason == BELOW_MIN_PARAMS for s in report.skipped) else ""
        warnings.warn(f"patch_model fused no module of {type(model).__name__}{hint}:\n{report}", stacklevel=2)
    return report


def unpatch_model(model: nn.Module) -> list[str]:
    """Restore every fused module to a plain nn.Linear / Conv1D with the same Parameter
    objects and hooks (fused optimizer state is dropped). Returns the restored names."""
    restored = []
    for name, parent in list(model.named_modules()):
        for attr, child in list(parent._modules.items()):
            if isinstance(child, FusedWeightMixin):
                parent._modules[attr] = _release(child)
                restored.append(f"{name}.{attr}" if name else attr)
    return restored
