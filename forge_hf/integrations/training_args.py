"""What a TrainingArguments asks of forge: the ``optim="forge_<rule>"`` names, registered with
transformers by an ordinary call, and the ForgeConfig those arguments carry."""

from __future__ import annotations

from ..core.config import (
    ForgeConfig,
    OptionError,
    OptionTypeError,
    did_you_mean,
    option_type,
    resolve_config,
    trainer_keys,
)
from ..core.rules import RULES, Rule

PREFIX = "forge_"
OPTIMIZER_NAMES = tuple(PREFIX + name for name in RULES)  # forge_adamw, forge_nadam, ...


def rule_name(optim) -> str | None:
    """'adamw' for optim='forge_adamw' (a string or an OptimizerNames member), else None."""
    value = str(getattr(optim, "value", optim))
    name = value[len(PREFIX):] if value.startswith(PREFIX) else None
    return name if name in RULES else None


# ------------------------------------------------------------------ registration


def _add_enum_member(enum_cls, name: str, value: str) -> None:
    """Add a member to a str-valued Enum after its creation (the Enum API has no way)."""
    if value in enum_cls._value2member_map_:
        return
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    setattr(enum_cls, name, member)  # before _member_map_, which forbids reassigning members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)


def _refuse_plain_trainer(get_optimizer_cls_and_kwargs):
    def wrapped(args, model=None):
        if rule_name(args.optim) is not None:
            raise ValueError(
                f"optim={args.optim.value!r} needs forge_hf.ForgeTrainer: a plain Trainer would clip "
                "and log only the gradients that are not fused. Use forge_hf.ForgeTrainer in place of "
                "Trainer, or for another Trainer subclass (e.g. trl.SFTTrainer) "
                "`class MyTrainer(forge_hf.ForgeTrainerMixin, SFTTrainer)`"
            )
        return get_optimizer_cls_and_kwargs(args, model)

    wrapped.forge_refusal = True
    return wrapped


def add_optimizer_names() -> None:
    """The forge_<rule> names among TrainingArguments' ``optim`` choices (OptimizerNames);
    idempotent. register_optimizer_names does this and more."""
    from transformers.training_args import OptimizerNames

    for value in OPTIMIZER_NAMES:
        _add_enum_member(OptimizerNames, value.upper(), value)


def refuse_names_in_plain_trainer() -> None:
    """A plain Trainer given a forge_<rule> name stops when it creates its optimizer; idempotent."""
    from transformers.trainer import Trainer

    current = Trainer.get_optimizer_cls_and_kwargs  # a staticmethod: the plain function
    if not getattr(current, "forge_refusal", False):
        Trainer.get_optimizer_cls_and_kwargs = staticmethod(_refuse_plain_trainer(current))


def register_optimizer_names() -> None:
    """Make ``TrainingArguments(optim="forge_<rule>")`` valid (also through HfArgumentParser)
    and a plain Trainer refuse those names, now; idempotent. ``import forge_hf`` arranges the
    same for whenever transformers loads (import_hook.py)."""
    add_optimizer_names()
    refuse_names_in_plain_trainer()


# ----------------------------------------------------------------- options


def _hyperparameters_from_args(rule: Rule, args) -> dict[str, tuple[str, object]]:
    """rule hyperparameter -> (TrainingArguments field, value), as Trainer's own optimizers do."""
    given = {"lr": ("learning_rate", args.learning_rate), "weight_decay": ("weight_decay", args.weight_decay)}
    if "betas" in rule.defaults:  # the Adam family and Lion; RMSprop/Adagrad keep their own eps
        given["betas"] = ("adam_beta1/adam_beta2", (args.adam_beta1, args.adam_beta2))
        if "eps" in rule.defaults:
            given["eps"] = ("adam_epsilon", args.adam_epsilon)
    return given


def _from_text(key: str, text: str, kind: type):
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"optim_args {key}={text!r}: use true or false")
        return text.lower() in ("true", "1")
    if kind is list:
        return text.split("|")  # lists travel '|'-joined inside the comma-separated string
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"optim_args {key}={text!r}: use a{'n' if kind is int else ''} {kind.__name__}") from None


def config_from_training_args(args, options: dict | None = None) -> ForgeConfig:
    """The ForgeConfig of a ``forge_<rule>`` TrainingArguments: the rule from ``optim``, the
    hyperparameters from the usual fields (learning_rate, weight_decay, adam_*), the seed,
    and the rest from ``optim_args`` ("state_precision=bf16,momentum=0.9") and ``options``
    (a recipe's forge_* keys, by option name). A bad or repeated value raises ValueError
    naming where it was set."""
    name = rule_name(args.optim)
    if name is None:
        raise ValueError(f"optim={getattr(args.optim, 'value', args.optim)!r} is not a forge optimizer: "
                         f"use one of {list(OPTIMIZER_NAMES)}")
    rule, keys = RULES[name], trainer_keys()
    from_args = _hyperparameters_from_args(rule, args)
    hyperparameters = {k: v for k, (_, v) in from_args.items()}
    options = dict(options or {})
    where = {k: f"forge_{k}" for k in options}  # option -> the key that set it, for the errors
    for pair in (args.optim_args or "").replace(" ", "").split(","):
        if not pair:
            continue
        if "=" not in pair:
            raise ValueError(f"optim_args entry {pair!r} is not key=value: write e.g. "
                             "optim_args='momentum=0.9'")
        key, text = pair.split("=", 1)
        if key in from_args:
            raise ValueError(f"optim_args sets {key}={text} but {PREFIX}{name} takes {key} from "
                             f"TrainingArguments.{from_args[key][0]}: set it there")
        if key in options:
            raise ValueError(f"{key} is set twice, as forge_{key} and inside optim_args={args.optim_args!r}: "
                             "keep one")
        if key in keys:
            options[key] = _from_text(key, text, option_type(keys[key]))
            where[key] = f"optim_args {key}"
        elif key in rule.defaults:
            hyperparameters[key] = _from_text(key, text, type(rule.defaults[key]))
            where[key] = f"optim_args {key}"
        else:
            accepted = sorted(set(rule.defaults) - set(from_args) | set(keys))
            raise ValueError(f"unknown optim_args key {key!r} for optim='{PREFIX}{name}'"
                             f"{did_you_mean(key, accepted)}: it takes {accepted}")
    try:
        return ForgeConfig(optimizer=name, seed=args.seed, hyperparameters=hyperparameters, **options)
    except (OptionError, OptionTypeError) as e:
        source = where.get(e.option)
        if e.option == "hyperparameters":
            source = next((where[k] for k in where if k in rule.defaults and f"{k}=" in str(e)), None)
        raise ValueError(f"{source}: {e}" if source else str(e)) from None


def merged_config(args, given: ForgeConfig) -> ForgeConfig:
    """ForgeTrainer's config when the caller hands it a ForgeConfig: the TrainingArguments'
    own (hyperparameters from their fields, seed, optim_args), with the given config's options
    added; a value the two set differently is refused."""
    if rule_name(args.optim) != given.optimizer:
        raise ValueError(f"forge_config is for optimizer={given.optimizer!r} but args.optim="
                         f"{getattr(args.optim, 'value', args.optim)!r}: set optim='{PREFIX}{given.optimizer}'")
    base = config_from_training_args(args)
    mine, theirs = given.trainer_options(), base.trainer_options()
    for key in sorted(mine.keys() & theirs.keys()):
        if mine[key] != theirs[key]:
            raise ValueError(f"forge_config sets {key}={mine[key]!r} but the TrainingArguments give {theirs[key]!r} "
                             "(their own field or optim_args): set it in one place")
    return resolve_config(base, {k: v for k, v in mine.items() if k not in theirs})
