"""YAML recipe -> (ModelArguments, DataArguments, ForgeArguments, TrainingArguments).

A recipe is one flat mapping whose keys are fields of those four dataclasses
(``python -m forge_hf.train --help`` lists them all). Command-line overrides follow the
recipe path in HfArgumentParser's own syntax and win over the file::

    python -m forge_hf.train recipes/smoke.yaml --learning_rate 1e-3 --max_steps 20

Relative input paths in the file (model_name_or_path, model_config,
tokenizer_name_or_path, data_files) are taken relative to the recipe's directory when
they exist there, so a recipe runs from any working directory; anything else (hub ids,
output_dir, resume_from_checkpoint, paths given on the command line) is used as written.

Everything that can be checked without the model is checked here, so a bad value stops
with one line (file, key, value, fix) before anything loads or is written.
"""

import argparse
import enum
import glob
import importlib.util
import os
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml
from transformers import TrainingArguments

from ..core.config import ForgeConfig, closest
from ..integrations.checkpoints import CheckpointError, check_checkpoint, latest_checkpoint
from ..integrations.lean_loss import check_lean_loss
from ..integrations.trainer import check_training_arguments  # registers the forge_* optim names
from ..integrations.training_args import OPTIMIZER_NAMES, PREFIX, config_from_training_args, rule_name
from .arguments import DataArguments, ForgeArguments, ModelArguments, recipe_parser
from .data import LOCAL_FORMATS

ARGUMENT_CLASSES = (ModelArguments, DataArguments, ForgeArguments, TrainingArguments)
PATH_KEYS = ("model_name_or_path", "model_config", "tokenizer_name_or_path", "data_files")
PATH_NOTE = ("(a relative path is relative to the recipe's directory in the file, to the working "
             "directory on the command line)")
FLOAT16_FIX = ("fused layers step fp32 or bf16 weights, and float16 training needs a gradient scaler, which "
               "a fused step cannot use: use dtype: bfloat16, or dtype: float32 with bf16: true (autocast)")


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file, the key and the fix."""


@dataclass
class Recipe:
    path: Path
    model: ModelArguments
    data: DataArguments
    forge: ForgeArguments
    training: TrainingArguments
    config: ForgeConfig | None = None  # built from forge and training by check_recipe


def load_recipe(path, overrides=()) -> Recipe:
    """Parse ``path`` and the command-line ``overrides`` (``["--key", "value", ...]``)."""
    path = Path(path)
    values = _resolve_paths(_check_values(read_yaml(path), path), path.parent)
    _check_override_choices(list(overrides), path)
    parser = recipe_parser()
    parser.set_defaults(**values)
    try:
        *parsed, rest = parser.parse_args_into_dataclasses(
            args=list(overrides), look_for_args_file=False, return_remaining_strings=True)
    except argparse.ArgumentError as e:
        raise RecipeError(f"{path}: command-line override {e}: write overrides as --key value, or --key=value "
                          "for a value starting with '-' (argparse reads -1e-3 as an option)") from None
    except ValueError as e:  # a dataclass's own validation (__post_init__)
        raise RecipeError(f"{path}: {e}") from None
    if rest:
        raise RecipeError(f"{path}: unknown command-line override(s) {rest}: write --key value with keys "
                          "from `python -m forge_hf.train --help`")
    recipe = Recipe(path, *parsed)
    check_recipe(recipe)
    return recipe


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a repeated key instead of silently keeping the last one."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first on line {first_line[key]}): keep one",
                    key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_error(path: Path, error: yaml.YAMLError) -> str:
    """One line, located in the file: PyYAML's own message spans several and names no path."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"{path}: not valid YAML: {' '.join(str(error).split())}"
    mark, context = error.problem_mark, error.context_mark
    started = f" ({error.context} from line {context.line + 1})" if error.context and context else ""
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {error.problem}{started}"


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist: give the path of a .yaml recipe "
                          "(see recipes/)")
    try:
        with path.open(encoding="utf-8") as stream:
            values = yaml.load(stream, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise RecipeError(_yaml_error(path, e)) from None
    if values is None:
        raise RecipeError(f"{path}: the file is empty (no `key: value` lines): write the recipe's keys, "
                          "e.g. starting from recipes/smoke.yaml")
    if not isinstance(values, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of `key: value` lines, got {type(values).__name__}")
    return values


def _field_types() -> dict:
    hints = {}
    for cls in ARGUMENT_CLASSES:
        types_of = typing.get_type_hints(cls)
        hints.update({f.name: types_of[f.name] for f in fields(cls) if f.init})
    return hints


def _check_values(values: dict, path: Path) -> dict:
    """Unknown keys and wrong types, each named with the file."""
    hints = _field_types()
    checked = {}
    for key, value in values.items():
        if key not in hints:
            close = closest(str(key), hints)
            hint = f"did you mean {close!r}? " if close else ""
            raise RecipeError(f"{path}: unknown key {key!r}: {hint}keys are the fields listed by "
                              "`python -m forge_hf.train --help`")
        if key == "resume_from_checkpoint" and isinstance(value, bool):
            value = "true" if value else None  # YAML's `true`: Hugging Face's "the latest checkpoint"
        ok, converted = _matches(value, hints[key])
        if not ok:
            raise RecipeError(f"{path}: {_wrong_value(key, value, hints[key], 'in the file')}")
        checked[key] = converted
    return checked


def _check_override_choices(overrides: list[str], path: Path) -> None:
    """A command-line value outside its key's choices (optim, lr_scheduler_type,
    forge_backend, ...), reported as in the file rather than with argparse's list of all."""
    hints = _field_types()
    for i, token in enumerate(overrides):
        key, eq, value = token.removeprefix("--").partition("=")
        key = key.replace("-", "_")  # HfArgumentParser also takes --lr-scheduler-type
        if not token.startswith("--") or key not in hints or _choices(hints[key]) is None:
            continue
        if not eq:
            if i + 1 == len(overrides) or overrides[i + 1].startswith("--"):
                continue  # argparse reports the missing value
            value = overrides[i + 1]
        if not _matches(value, hints[key])[0]:
            raise RecipeError(f"{path}: command-line override --{key}: "
                              f"{_wrong_value(key, value, hints[key], 'on the command line')}")


def _wrong_value(key: str, value, hint, where: str) -> str:
    if key == "optim":
        return not_a_forge_optimizer(value)
    close = closest(str(value), _choices(hint) or [])
    suggestion = f"did you mean {close!r}? " if close else ""
    return (f"key {key!r} expects {_describe(hint)}, got {value!r} ({type(value).__name__}): "
            f"{suggestion}fix the value {where}")


def not_a_forge_optimizer(optim) -> str:
    """The refusal of a non-forge optim (forge-hf trains with ForgeTrainer), with the
    closest forge name."""
    name = _name(optim)
    bare = name.removeprefix(PREFIX).lower()
    rules = [n.removeprefix(PREFIX) for n in OPTIMIZER_NAMES]
    # transformers' names contain the rule they implement (adamw_torch_fused, paged_lion_8bit)
    close = max((r for r in rules if r in bare), key=len, default=None) or closest(bare, rules)
    suggestion = f"did you mean {PREFIX + close!r}? " if close else ""
    return f"optim={name!r} is not a forge optimizer: {suggestion}forge-hf trains with {', '.join(OPTIMIZER_NAMES)}"


def _matches(value, hint):
    """(whether value fits the type hint, the value to use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        # HfArgumentParser reads `SomeEnum | str` as the enum's choices; so do we
        arms = [a for a in args if a is not str] if any(_is_enum(a) for a in args) else args
        for arm in arms:
            ok, converted = _matches(value, arm)
            if ok:
                return True, converted
        return False, value
    if origin is typing.Literal:
        if isinstance(value, bool) and str(value).lower() in args:  # YAML's true for the choice 'true'
            return True, str(value).lower()
        return value in args, value
    if _is_enum(hint):
        return (isinstance(value, hint) or (isinstance(value, str) and _enum_accepts(hint, value))), value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads `2e-5` (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if origin is list or hint is list:
        if not isinstance(value, list):
            return False, value
        if not args:
            return True, value
        pairs = [_matches(v, args[0]) for v in value]
        return all(ok for ok, _ in pairs), [v for _, v in pairs]
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value  # a typing form we do not check; the dataclass validates it


def _choices(hint) -> list[str] | None:
    """The values a Literal or Enum key (or a union with one) accepts; None for other keys."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        found = [c for c in map(_choices, args) if c is not None]
        return [c for cs in found for c in cs] if found else None
    if origin is typing.Literal:
        return [str(a) for a in args]
    if _is_enum(hint):
        return [str(m.value) for m in hint]
    return None


def _is_enum(hint) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _enum_accepts(cls, value: str) -> bool:
    try:
        cls(value)
        return True
    except ValueError:
        return False


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not str] if any(_is_enum(a) for a in args) else args
        return " or ".join(_describe(a) for a in arms)
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if _is_enum(hint):
        return f"one of {[m.value for m in hint]}"
    if origin is list or hint is list:
        return f"a list ({_describe(args[0])} each)" if args else "a list"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
             str: "a string", dict: "a mapping"}
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))


def _resolve_paths(values: dict, base: Path) -> dict:
    def resolve(p: str) -> str:
        if os.path.isabs(p) or not (glob.glob(str(base / p)) or (base / p).exists()):
            return p
        return os.path.normpath(base.resolve() / p)

    for key in PATH_KEYS:
        value = values.get(key)
        if isinstance(value, str):
            values[key] = resolve(value)
        elif isinstance(value, list):
            values[key] = [resolve(v) for v in value]
    return values


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or value.endswith(".json")


def check_recipe(recipe: Recipe) -> None:
    """Combinations no run can satisfy, and files that are not there."""
    path, m, d, f, t = recipe.path, recipe.model, recipe.data, recipe.forge, recipe.training

    def fail(msg):
        raise RecipeError(f"{path}: {msg}")

    if (m.model_name_or_path is None) == (m.model_config is None):
        fail("set exactly one of model_name_or_path (continue training pretrained weights) and "
             f"model_config (random init), got model_name_or_path={m.model_name_or_path!r}, "
             f"model_config={m.model_config!r}")
    for key in ("model_name_or_path", "model_config", "tokenizer_name_or_path"):
        value = getattr(m, key)
        if value and _looks_local(value) and not os.path.exists(os.path.expanduser(value)):
            fail(f"{key}: {value!r} does not exist: fix the path {PATH_NOTE}")
    if m.model_config and m.model_config.endswith(".json") and not m.tokenizer_name_or_path:
        fail(f"model_config={m.model_config!r} is a config file, which holds no tokenizer: set "
             "tokenizer_name_or_path")
    if m.dtype == "float16":
        fail(f"dtype='float16' cannot train with forge optimizers: {FLOAT16_FIX}")

    if d.dataset_source == "local":
        if not d.data_files:
            fail("dataset_source: local needs data_files (a list of .jsonl or .parquet files)")
        d.data_files = _expand_data_files(d.data_files, fail)
    elif d.data_files:
        fail(f"data_files={d.data_files} is set but dataset_source is 'hub': set dataset_source: local "
             "to read the files, or remove data_files")

    if t.max_steps <= 0:
        fail(f"max_steps={t.max_steps}: the packed blocks repeat the rows pass after pass, so the run "
             "length must be given as max_steps")
    if t.learning_rate < 0:
        fail(f"learning_rate={t.learning_rate} is negative, which steps up the loss: use a positive "
             "learning_rate, e.g. 2e-5")
    if t.train_sampling_strategy not in ("random", "sequential"):
        fail(f"train_sampling_strategy={t.train_sampling_strategy!r}: the blocks all hold block_size tokens and "
             "come in the rows' seeded order (shuffle, data_seed): remove the key")
    # The order is the rows' (data.py's seeded shuffle): the Trainer reads the run's blocks in
    # turn, so a resume skips to the same block whatever max_steps or the pass
    t.train_sampling_strategy = "sequential"
    if t.eval_strategy != "no" and d.eval_rows == 0:
        fail(f"eval_strategy={_name(t.eval_strategy)!r} needs a held-out slice: set eval_rows > 0, "
             "or eval_strategy: 'no'")
    t.resume_from_checkpoint = _checkpoint_to_resume(t.resume_from_checkpoint, t.output_dir, fail)

    if rule_name(t.optim) is None:
        fail(not_a_forge_optimizer(t.optim))
    try:  # the options and ForgeTrainer's own refusals, reported now rather than after the model loads
        recipe.config = config_from_training_args(t, f.options())
        check_training_arguments(t)
    except ValueError as e:
        fail(str(e))
    _check_config_fits(recipe.config, f, t, fail)


def _check_config_fits(config: ForgeConfig, forge, t: TrainingArguments, fail) -> None:
    """What the options ask that the machine or the other arguments cannot give, found
    before the model is loaded."""

    def key(name: str) -> str:  # the recipe key that set the option
        return f"forge_{name}" if getattr(forge, f"forge_{name}") is not None else f"optim_args {name}"

    missing = _triton_missing(t) if config.backend == "triton" else None
    if missing:
        fail(f"{key('backend')}='triton' needs Triton and a CUDA GPU, but {missing}: use auto (Triton "
             "where it can run, else the reference backend) or reference")
    if config.lean_loss == "true":
        try:
            check_lean_loss(t, option=f"{key('lean_loss')}=true")
        except ValueError as e:
            fail(str(e))
    if config.cuda_graph == "true":
        uncapturable = _uncapturable(config, t)
        if uncapturable:
            fail(f"{key('cuda_graph')}=true refuses to train without a CUDA graph, and {uncapturable}: use auto "
                 "(captures where it can) or false")


def _triton_missing(t: TrainingArguments) -> str | None:
    """Why the Triton kernels cannot run this recipe's fused steps, or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None  # Triton's interpreter runs the kernels on CPU tensors (the tests' setting)
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    if t.use_cpu:
        return "use_cpu: true keeps the model on the CPU"
    return None


def _uncapturable(o: ForgeConfig, t: TrainingArguments) -> str | None:
    """What of the recipe keeps any step from being captured (integrations/cuda_graph.py)."""
    if t.gradient_checkpointing:  # transformers 5.2x mirrors activation_checkpointing here
        return "activation checkpointing recomputes the forward inside backward, which a capture cannot hold"
    if o.stop_on_nonfinite:
        return "stop_on_nonfinite reads a count on the host inside every step"
    if not torch.cuda.is_available() or t.use_cpu:
        return "the model will not be on a CUDA device"
    return None


def _checkpoint_to_resume(value: str | None, output_dir: str, fail) -> str | None:
    """resume_from_checkpoint as a checkpoint directory that can be resumed: true means the
    newest checkpoint-N in output_dir whose save finished (integrations/checkpoints.py), false none."""
    if value is None or value.lower() == "false":
        return None
    try:
        if value.lower() == "true":
            latest = latest_checkpoint(output_dir)
            if latest is None:
                fail(f"resume_from_checkpoint: true resumes from the latest checkpoint-N in output_dir, and "
                     f"{output_dir!r} holds none: give the checkpoint's path, or the output_dir it was saved in")
            return latest
        return check_checkpoint(value)
    except CheckpointError as e:
        fail(f"resume_from_checkpoint={value}: {e}")


def _name(value) -> str:
    return str(getattr(value, "value", value))


def _expand_data_files(patterns: list[str], fail) -> list[str]:
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            fail(f"data_files: {pattern!r} matches no file: fix the path {PATH_NOTE}")
        files += matched
    formats = {LOCAL_FORMATS.get(Path(p).suffix) for p in files}
    if None in formats or len(formats) > 1:
        fail(f"data_files: {files} must all be .jsonl/.json or all .parquet")
    return files
