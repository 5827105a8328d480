"""The recipe's own argument groups. A recipe is one flat YAML mapping over these fields and
every ``TrainingArguments`` field, parsed by ``recipe_parser`` (forge_hf.train.recipe reads
and checks it). Importing this module loads neither torch nor transformers, so ``forge-hf
train --help`` lists these groups at once.

Liger, gradient checkpointing, seeds and the optimizer name are TrainingArguments fields
already (``use_liger_kernel``, ``gradient_checkpointing``, ``seed``/``data_seed``,
``optim``), so they are not repeated here."""

import string
from dataclasses import dataclass, field, make_dataclass
from typing import Literal

from ..core.config import _default, option_type, trainer_keys

OMI2_COLUMNS = ("problem", "generated_solution", "expected_answer", "problem_source")


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or directory of pretrained weights to continue training."})
    model_config: str | None = field(
        default=None, metadata={"help": "Hub id, directory or config.json: train a randomly initialised "
                                        "model of this shape instead (seeded by `seed`)."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision of the model and config."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Defaults to model_name_or_path, or model_config when that is a "
                                        "hub id or directory."})
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(
        default="float32", metadata={"help": "Weight dtype. bfloat16 = bf16 everywhere (the paper's "
                                             "setting); float32 + `bf16: true` = autocast mixed precision. "
                                             "float16 cannot train with forge (it needs a gradient scaler)."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "e.g. sdpa, eager, flash_attention_2; default: transformers' choice."})
    tp_plan: Literal["auto"] | None = field(
        default=None, metadata={"help": "auto: tensor parallelism, each linear split over the ranks of `torchrun "
                                        "--nproc_per_node N` by the model's own plan; each rank holds 1/N of the "
                                        "weights and states and sees every batch (docs/parallelism.md)."})

    def __post_init__(self):
        if self.tp_plan is not None and not self.model_name_or_path:
            raise ValueError(f"tp_plan={self.tp_plan!r} splits pretrained weights as they load: set "
                             "model_name_or_path (a model_config's random model is built whole), or drop tp_plan")


@dataclass
class DataArguments:
    _argument_group_name = "data"

    dataset_source: Literal["hub", "local"] = field(
        default="hub", metadata={"help": "hub: dataset_name from the Hub; local: data_files."})
    dataset_name: str = field(default="nvidia/OpenMathInstruct-2")
    dataset_split: str = field(default="train_1M", metadata={"help": "train, train_1M, train_2M or train_5M."})
    dataset_revision: str = field(
        default="main", metadata={"help": "Pin a commit hash of the dataset repository for reproducible runs."})
    data_files: list[str] | None = field(
        default=None, metadata={"help": "Local .jsonl/.json or .parquet files (globs allowed) with "
                                        "OpenMathInstruct-2's columns."})
    streaming: bool = field(default=False, metadata={"help": "Read rows lazily (IterableDataset); a resume reads "
                                                             "and tokenises them again up to the checkpoint."})
    text_template: str = field(
        default="{problem}\n\n{generated_solution}",
        metadata={"help": f"str.format template over the columns {list(OMI2_COLUMNS)}; EOS is appended "
                          "after each row. Write literal braces as {{ }}."})
    block_size: int = field(default=512, metadata={"help": "Tokens per packed training sequence."})
    eval_rows: int = field(
        default=0, metadata={"help": "The first N source rows are held out (before shuffling) for evaluation."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle training rows, seeded by data_seed or seed."})
    shuffle_buffer_size: int = field(
        default=10_000, metadata={"help": "Streaming only: rows in the shuffle buffer."})

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block needs at least 2 tokens")
        if self.eval_rows < 0:
            raise ValueError(f"eval_rows={self.eval_rows}: use 0 (no held-out slice) or a positive count")
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size={self.shuffle_buffer_size}: must be at least 1")
        if isinstance(self.data_files, str):
            self.data_files = [self.data_files]
        names = {name for _, name, _, _ in string.Formatter().parse(self.text_template) if name is not None}
        unknown = sorted(names - set(OMI2_COLUMNS))
        if unknown:
            raise ValueError(f"text_template uses {unknown}, which are not columns: use "
                             f"{{}}-placeholders from {list(OMI2_COLUMNS)}")


def _forge_field(option) -> tuple[str, object, object]:
    """The recipe key ``forge_<name>`` of a ForgeConfig option: its choices or type, unset by
    default (the config's own default applies)."""
    choices, kind = option.metadata["choices"], option_type(option)
    hint = Literal[choices] if choices else list[str] if kind is list else kind
    default = _default(option)
    if isinstance(default, tuple):
        unset = ", ".join(default) or "none"
    else:
        unset = f"{default:,}" if type(default) is int else str(default).lower()
    return (f"forge_{option.name}", hint | None,
            field(default=None, metadata={"help": f"{option.metadata['help']} Unset: {unset}."}))


def _set_options(self) -> dict:
    """The options the recipe sets, by ForgeConfig name (state_precision, rounding, ...)."""
    return {name.removeprefix("forge_"): value for name, value in vars(self).items() if value is not None}


# ForgeTrainer's options as recipe keys: one forge_<name> field per ForgeConfig option that
# TrainingArguments' optim_args could set, so the two cannot drift apart
ForgeArguments = make_dataclass(
    "ForgeArguments", [_forge_field(option) for option in trainer_keys().values()],
    namespace={"_argument_group_name": "forge", "options": _set_options,
               "__doc__": "The recipe's forge_* keys: ForgeConfig's options (core/config.py)."})
ForgeArguments.__module__ = __name__


OPTIM_ARGS_HELP = (
    "Comma-separated key=value options of the optimizer. For optim: forge_<rule>, the rule's own "
    "hyperparameters (e.g. momentum=0.9 for forge_sgd; lr, weight_decay, betas and eps come from "
    "learning_rate, weight_decay, adam_beta1/adam_beta2 and adam_epsilon) and the forge options "
    f"{', '.join(trainer_keys())} (lists '|'-joined), which the forge_* keys set one by one."
)


def recipe_parser():
    """HfArgumentParser over every recipe key: these groups and TrainingArguments' fields,
    whose module takes seconds to import."""
    from transformers import HfArgumentParser, TrainingArguments

    from ..integrations.training_args import add_optimizer_names

    add_optimizer_names()  # optim's choices include forge_<rule>; transformers' Trainer need not load
    parser = HfArgumentParser((ModelArguments, DataArguments, ForgeArguments, TrainingArguments),
                              usage="python -m forge_hf.train RECIPE.yaml [--key value ...]",
                              allow_abbrev=False, exit_on_error=False)
    next(a for a in parser._actions if a.dest == "optim_args").help = OPTIM_ARGS_HELP
    return parser
