"""ForgeConfig: every forge option, declared once and validated once, where the user hands it
in (keyword arguments, a TrainingArguments' ``optim_args``, a recipe's ``forge_*`` keys).
Every other module reads the options from this object; the rule's hyperparameters are
owned by the optimizer's param groups once it exists (optim/optimizer.py)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields

from .precision_checks import check_group
from .rules import RULES, Rule, get_rule, make_group

STATE_PRECISIONS = ("auto", "fp32", "bf16", "int8", "al8", "log4", "log4_factored")
ROUNDINGS = ("stochastic", "nearest")
BACKENDS = ("auto", "triton", "reference")
DATA_PARALLEL_MODES = ("sharded", "replicated")
# cuda_graph, lean_loss, recompute_swiglu: auto takes it where it applies, true refuses to
# train without it, false never; True and False are read as "true" and "false"
SWITCH_MODES = ("auto", "true", "false")
ACCUMULATION_MODES = ("auto", "stash", "buffer", "bf16_buffer")
# state_precision="auto": the weight's own dtype, as torch.optim keeps its states
AUTO_STATE_PRECISION = {"bfloat16": "bf16", "float32": "fp32"}

# Below 64K weights (four 128x128 tiles) a fused launch cannot fill a GPU and saves under
# 256 KiB of gradient; a torch optimizer steps such tensors in one batched launch.
# PEFT adapters (LoRA's lora_A / lora_B, ...) stay on the ordinary path too while
# min_params > 0, whatever their size: their gradients are a few MiB, formed after the
# step's memory peak, and a fused step over rank-r rows is slower (docs/performance.md).
DEFAULT_MIN_PARAMS = 1 << 16

# Who acts on an option: patch_model, ForgeOptimizer, or only ForgeTrainer.
PATCH, OPTIMIZER, TRAINER = "patch_model", "ForgeOptimizer", "ForgeTrainer"


def _option(default, used_by: str, help: str, choices: tuple | None = None, trainer_key: bool = True):
    """A ForgeConfig field. ``trainer_key``: settable as an optim_args key and a recipe's
    ``forge_<name>`` key (the optimizer name, seed and hyperparameters come from
    TrainingArguments' own fields instead)."""
    kwargs = dict(default_factory=default) if callable(default) else dict(default=default)
    return field(**kwargs, metadata=dict(used_by=used_by, help=help, choices=choices, trainer_key=trainer_key))


@dataclass(frozen=True)
class ForgeConfig:
    """The options of a forge run (the README's options table). Build it with keyword
    arguments (``ForgeConfig(state_precision="bf16", hyperparameters={"lr": 1e-4})``, or
    ``ForgeConfig.from_options(state_precision="bf16", lr=1e-4)``) or from TrainingArguments
    (integrations/training_args.py); a bad value raises at once, naming it and the fix."""

    optimizer: str = _option("adamw", PATCH, "The element-wise rule: " + ", ".join(RULES) + ".",
                             tuple(RULES), trainer_key=False)
    state_precision: str = _option(
        "auto", PATCH, "Optimizer-state storage: auto (each weight's own dtype: bf16 states for bf16 weights, "
        "fp32 for fp32 weights, as torch.optim keeps them), fp32, bf16, or 8-bit int8 / al8 in the fused layers "
        "(codes with per-block scales), or 4-bit log4 there (power-of-two codes, a bf16 scale per 64 elements of a "
        "row: 0.53 bytes a state element; not for centered RMSprop), or log4_factored (log4 first moments, the "
        "second moment as fp32 row and column sums: ~0.53 bytes a parameter for AdamW; rules with a second "
        "moment).", STATE_PRECISIONS)
    rounding: str = _option("stochastic", PATCH, "How bf16 weights and states are rounded when stored.",
                            ROUNDINGS)
    backend: str = _option(
        "auto", PATCH, "What runs the fused step: triton (GPU kernels; needs a CUDA GPU), reference (PyTorch, "
        "runs anywhere) or auto (triton where it can run, else reference).", BACKENDS)
    include: tuple[str, ...] = _option(tuple, PATCH, "Fuse only modules matching these names or patterns.")
    exclude: tuple[str, ...] = _option(tuple, PATCH, "Never fuse modules matching these names or patterns.")
    min_params: int = _option(
        DEFAULT_MIN_PARAMS, PATCH, "Weights with fewer entries, and PEFT adapters, stay on the ordinary "
        "optimizer; 0 fuses every eligible linear.")
    fuse_embedding: str = _option(
        "auto", PATCH, "Step the input embedding from the rows each batch touches, summed into a compact "
        "buffer, with no dense gradient (the same step): auto (where that is exact and saves memory: a plain, "
        "trainable nn.Embedding not tied to the output head, in one process), true (refuse a model where it "
        "cannot) or false.", SWITCH_MODES)
    seed: int = _option(0, PATCH, "Seed of the stochastic-rounding streams (ForgeTrainer: TrainingArguments.seed).",
                        trainer_key=False)
    stop_on_nonfinite: bool = _option(False, OPTIMIZER, "Stop training when a tile's gradient is not finite.")
    accumulation: str = _option(
        "auto", OPTIMIZER, "With gradient accumulation or clipping, how a fused layer holds its gradient until the "
        "optimizer step: stash (its input and output gradient rows), buffer (an fp32 weight gradient: exact), "
        "bf16_buffer (a bf16 weight gradient whose sums round stochastically: unbiased; bf16 weights only) or "
        "auto (never more than a plain Trainer's gradient of the layer: stash while its rows take no more, then "
        "buffer where that fits, fp32 weights, else bf16_buffer).", ACCUMULATION_MODES)
    data_parallel: str = _option(
        "sharded", TRAINER, "Several processes: sharded (each rank keeps the states of its weight rows) or "
        "replicated.", DATA_PARALLEL_MODES)
    recompute_swiglu: str = _option(
        "auto", TRAINER, "SwiGLU MLPs keep gate and up only and form their product again in backward "
        "(forge_hf.recompute_swiglu; bit-identical training, less activation memory): auto (every SwiGLU MLP "
        "whose down_proj is fused and not tensor-parallel), true (refuse a model without one) or false.", SWITCH_MODES)
    cuda_graph: str = _option(
        "auto", TRAINER, "Capture each training step as a CUDA graph and replay it: auto (where the step can be "
        "captured), true (refuse to train otherwise) or false.", SWITCH_MODES)
    graph_bucket: int = _option(
        64, TRAINER, "With cuda_graph: each batch's sequence length is padded up to a multiple of this many "
        "tokens (the padding masked out of the loss), so that batches of nearby lengths replay one graph; 1 "
        "keeps every length.")
    max_graphs: int = _option(
        8, TRAINER, "With cuda_graph: graphs kept at once, one per batch shape, all in one memory pool; a "
        "batch of a further shape runs eagerly.")
    lean_loss: str = _option(
        "auto", TRAINER, "Compute a causal LM's loss by forge's chunked cross-entropy: the same loss without an "
        "fp32 copy of the logits and their gradient. auto (a causal LM with no compute_loss_func of yours, no "
        "compute_loss of the trainer's own (TRL's), no Liger fused linear cross-entropy, no label smoothing, no "
        "context parallelism), true (refuse to train "
        "otherwise) or false.", SWITCH_MODES)
    hyperparameters: dict = _option(
        dict, OPTIMIZER, "The rule's own hyperparameters under torch.optim's names (lr, betas, eps, "
        "weight_decay, momentum, ...); unset ones take the rule's defaults.", trainer_key=False)

    def __post_init__(self):
        for f in fields(self):
            _check(self, f)
        if self.state_precision in ("log4", "log4_factored"):
            check_group(self.rule, self.state_precision, self.group())
        # a copy: the caller's dict may change after; read it, never change it
        object.__setattr__(self, "hyperparameters", dict(self.hyperparameters))

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_options(cls, **options) -> ForgeConfig:
        """A config from keyword arguments: the option names, and the rule's hyperparameters
        (``lr=1e-4, betas=(0.9, 0.95)``) as they are."""
        return resolve_config(None, options)

    def replace(self, **options) -> ForgeConfig:
        """A copy with ``options`` changed (validated again)."""
        return dataclasses.replace(self, **options)

    @property
    def rule(self) -> Rule:
        return RULES[self.optimizer]

    def state_precision_for(self, dtype) -> str:
        """The precision a tensor of ``dtype`` (a torch.dtype) keeps its states in: the option,
        or under auto its own dtype's (fp32 for any dtype but bf16)."""
        if self.state_precision != "auto":
            return self.state_precision
        return AUTO_STATE_PRECISION.get(str(dtype).removeprefix("torch."), "fp32")

    def group(self) -> dict:
        """A param-group dict of the rule: its defaults overridden by the hyperparameters."""
        return make_group(self.rule, dict(self.hyperparameters))

    def trainer_options(self) -> dict:
        """The options a TrainingArguments' optim_args could set (name -> value) that differ
        from their defaults, and the rule's hyperparameters."""
        return {**{name: getattr(self, name) for name, f in trainer_keys().items()
                   if getattr(self, name) != _default(f)}, **self.hyperparameters}


def trainer_keys() -> dict[str, dataclasses.Field]:
    """The options a TrainingArguments' optim_args and a recipe's forge_* keys set, by name."""
    return {f.name: f for f in fields(ForgeConfig) if f.metadata["trainer_key"]}


def option_type(f: dataclasses.Field) -> type:
    """What an option's text is read as: bool, int, list (of patterns) or str."""
    return {"bool": bool, "int": int, "tuple[str, ...]": list}.get(str(f.type), str)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class OptionError(ValueError):
    """A forge option with a value it cannot take; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class OptionTypeError(TypeError):
    """A forge option of the wrong type; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def closest(word: str, choices) -> str | None:
    """The choice most like ``word`` (difflib's ratio, at least 0.6), ties going to the
    longer common prefix: 'adamm' is closer to 'adamw' than to 'radam'."""
    def likeness(choice):
        return difflib.SequenceMatcher(None, word, choice).ratio(), len(os.path.commonprefix([word, choice]))

    best = max(choices, key=likeness, default=None)
    return best if best is not None and likeness(best)[0] >= 0.6 else None


def did_you_mean(word, choices) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = closest(str(word), [str(c) for c in choices])
    return f" (did you mean {close!r}?)" if close else ""


def _check(config: ForgeConfig, f: dataclasses.Field) -> None:
    name, value = f.name, getattr(config, f.name)
    if name == "optimizer":
        try:
            object.__setattr__(config, name, get_rule(value).name)
        except (ValueError, AttributeError):
            raise OptionError(name, f"unknown optimizer {value!r} for forge: choose one of {sorted(RULES)}"
                                    f"{did_you_mean(value, RULES)}") from None
    elif f.metadata["choices"] is not None:
        if f.metadata["choices"] == SWITCH_MODES and isinstance(value, bool):
            value = "true" if value else "false"
            object.__setattr__(config, name, value)
        if value not in f.metadata["choices"]:
            raise OptionError(name, f"unknown {name}={value!r}: choose one of {list(f.metadata['choices'])}"
                                    f"{did_you_mean(value, f.metadata['choices'])}")
    elif name in ("include", "exclude"):
        patterns = (value,) if isinstance(value, str) else tuple(value or ())
        if not all(isinstance(p, str) and p for p in patterns):
            raise OptionTypeError(name, f"{name}={value!r}: give module-name patterns as non-empty strings")
        object.__setattr__(config, name, patterns)
    elif name in ("graph_bucket", "max_graphs"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(name, f"{name}={value!r} is not a count: use an integer >= 1")
    elif name in ("min_params", "seed"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fix = "an integer >= 0 (0 fuses every eligible linear)" if name == "min_params" else "an integer >= 0"
            raise OptionError(name, f"{name}={value!r} is not a count: use {fix}")
    elif f.type == "bool":
        if not isinstance(value, bool):
            raise OptionError(name, f"{name}={value!r}: use True or False")
    elif name == "hyperparameters":
        try:
            make_group(get_rule(config.optimizer), dict(value))
        except (TypeError, ValueError) as e:
            raise (OptionTypeError if isinstance(e, TypeError) else OptionError)(name, str(e)) from None


def resolve_config(config: ForgeConfig | None, options: dict) -> ForgeConfig:
    """The config an entry point that takes ``config=`` and keyword options works with:
    ``config`` (default: every option's default) with ``options`` applied, hyperparameters
    merged."""
    if config is not None and not isinstance(config, ForgeConfig):
        raise TypeError(f"config={config!r} is not a ForgeConfig: build one with forge_hf.ForgeConfig(...), "
                        "or pass the options as keyword arguments")
    if config is not None and not options:
        return config
    names = {f.name for f in fields(ForgeConfig)} - {"hyperparameters"}
    given = {k: v for k, v in options.items() if k in names}
    hyperparameters = {k: v for k, v in options.items() if k not in names}
    if config is None:
        return ForgeConfig(**given, hyperparameters=hyperparameters)
    return config.replace(**given, hyperparameters={**config.hyperparameters, **hyperparameters})
