"""YAML recipe -> (ModelArguments, DataArguments, ForgeArguments, TrainingArguments).

A recipe is one flat mapping whose keys are fields of those four dataclasses
(``python -m forge_hf.train --help`` lists them all). Command-line overrides follow the
recipe path in HfArgumentParser's own syntax and win over the file::

    python -m forge_hf.train recipes/smoke.yaml --learning_rate 1e-3 --max_steps 20

Relative input paths in the file (model_name_or_path, model_config,
tokenizer_name_or_path, data_files) are taken relative to the recipe's directory when
they exist there, so a recipe runs from any working directory; anything else (hub ids,
output_dir, paths given on the command line) is used as written.
"""

import argparse
import difflib
import enum
import glob
import os
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

from ..integrations.trainer import check_training_arguments, forge_options, rule_name  # registers forge_* optim names
from .arguments import DataArguments, ForgeArguments, ModelArguments
from .data import LOCAL_FORMATS

ARGUMENT_CLASSES = (ModelArguments, DataArguments, ForgeArguments, TrainingArguments)
PATH_KEYS = ("model_name_or_path", "model_config", "tokenizer_name_or_path", "data_files")
PATH_NOTE = ("(a relative path is relative to the recipe's directory in the file, to the working "
             "directory on the command line)")


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the file, the key and the fix."""


@dataclass
class Recipe:
    path: Path
    model: ModelArguments
    data: DataArguments
    forge: ForgeArguments
    training: TrainingArguments


def recipe_parser() -> HfArgumentParser:
    return HfArgumentParser(ARGUMENT_CLASSES, usage="python -m forge_hf.train RECIPE.yaml [--key value ...]",
                            allow_abbrev=False, exit_on_error=False)


def load_recipe(path, overrides=()) -> Recipe:
    """Parse ``path`` and the command-line ``overrides`` (``["--key", "value", ...]``)."""
    path = Path(path)
    values = _resolve_paths(_check_values(read_yaml(path), path), path.parent)
    parser = recipe_parser()
    parser.set_defaults(**values)
    try:
        *parsed, rest = parser.parse_args_into_dataclasses(
            args=list(overrides), look_for_args_file=False, return_remaining_strings=True)
    except argparse.ArgumentError as e:
        raise RecipeError(f"{path}: command-line override {e}: write overrides as --key value") from None
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
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice: keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist: give the path of a .yaml recipe "
                          "(see recipes/)")
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
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
            close = difflib.get_close_matches(str(key), hints, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RecipeError(f"{path}: unknown key {key!r}: {hint}keys are the fields listed by "
                              "`python -m forge_hf.train --help`")
        ok, converted = _matches(value, hints[key])
        if not ok:
            raise RecipeError(f"{path}: key {key!r} expects {_describe(hints[key])}, got {value!r} "
                              f"({type(value).__name__}): fix the value in the file")
        checked[key] = converted
    return checked


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

    if d.dataset_source == "local":
        if not d.data_files:
            fail("dataset_source: local needs data_files (a list of .jsonl or .parquet files)")
        d.data_files = _expand_data_files(d.data_files, fail)
    elif d.data_files:
        fail(f"data_files={d.data_files} is set but dataset_source is 'hub': set dataset_source: local "
             "to read the files, or remove data_files")

    if t.max_steps <= 0:
        fail(f"max_steps={t.max_steps}: packed blocks are streamed and have no length, so the run "
             "length must be given as max_steps")
    if t.eval_strategy != "no" and d.eval_rows == 0:
        fail(f"eval_strategy={_name(t.eval_strategy)!r} needs a held-out slice: set eval_rows > 0, "
             "or eval_strategy: 'no'")

    options = f.options()
    if rule_name(t.optim) is None:
        if options:
            fail(f"{sorted('forge_' + k for k in options)} set, but optim={_name(t.optim)!r} is not a forge "
                 "optimizer: use optim: forge_adamw (or another forge_* name), or remove them")
        return
    t.optim_args = merge_optim_args(t.optim_args, options, fail)
    try:  # ForgeTrainer's own refusals, reported now rather than after the model loads
        forge_options(t)
        check_training_arguments(t)
    except ValueError as e:
        fail(str(e))


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


def merge_optim_args(optim_args: str | None, options: dict, fail) -> str:
    """optim_args with the forge_* options added as key=value pairs (lists '|'-joined, as
    integrations/trainer.py reads them)."""
    pairs = [p for p in (optim_args or "").replace(" ", "").split(",") if p]
    given = {p.split("=", 1)[0] for p in pairs}
    for key, value in options.items():
        if key in given:
            fail(f"{key} is set twice, as forge_{key} and inside optim_args={optim_args!r}: keep one")
        pairs.append(f"{key}={'|'.join(value) if isinstance(value, list) else value}")
    return ",".join(pairs)
