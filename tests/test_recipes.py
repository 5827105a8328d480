"""Recipes: every bundled one parses; bad ones stop with an error naming the file and key."""

from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml

from forge_hf.integrations.trainer import OPTION_TYPES, forge_options
from forge_hf.train.arguments import ForgeArguments
from forge_hf.train.recipe import PATH_KEYS, RecipeError, load_recipe

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
CPT_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "llama-3.1-8b")
# TrainingArguments refuses bf16 on a machine without a bf16 GPU unless use_cpu is set
HARDWARE = [] if torch.cuda.is_available() else ["--use_cpu", "true"]


def test_the_recipe_set_is_complete():
    names = {p.stem for p in RECIPES}
    expected = {f"{m}-cpt-{s}-state" for m in CPT_MODELS for s in ("bf16", "int8")}
    assert expected | {"smoke", "qwen3-1.7b-shape-random-local"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses(path):
    recipe = load_recipe(path, HARDWARE)
    assert forge_options(recipe.training).rule == "adamw"
    assert recipe.training.max_steps > 0


@pytest.mark.parametrize("model", CPT_MODELS)
@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_cpt_recipes_use_the_papers_settings(model, state):
    recipe = load_recipe(RECIPES_DIR / f"{model}-cpt-{state}-state.yaml", HARDWARE)
    t, d = recipe.training, recipe.data
    assert (t.per_device_train_batch_size, d.block_size, t.gradient_accumulation_steps) == (4, 512, 1)
    assert (t.learning_rate, t.warmup_steps, t.weight_decay) == (2e-5, 500, 0.01)
    assert (t.adam_beta1, t.adam_beta2, t.max_grad_norm) == (0.9, 0.999, 0.0)
    assert t.lr_scheduler_type == "cosine" and t.bf16 and t.use_liger_kernel
    assert recipe.model.dtype == "bfloat16"
    assert d.dataset_name == "nvidia/OpenMathInstruct-2" and d.streaming
    assert forge_options(t).patch["state_precision"] == state  # int8 is validated at patch time


def test_forge_arguments_cover_forge_trainers_options():
    assert {f.name for f in fields(ForgeArguments)} == {f"forge_{k}" for k in OPTION_TYPES}


def _smoke_values() -> dict:
    """smoke.yaml's values with its relative paths made absolute, to be rewritten elsewhere."""
    values = yaml.safe_load((RECIPES_DIR / "smoke.yaml").read_text())
    for key in PATH_KEYS:
        if isinstance(values.get(key), str):
            values[key] = str((RECIPES_DIR / values[key]).resolve())
        elif isinstance(values.get(key), list):
            values[key] = [str((RECIPES_DIR / v).resolve()) for v in values[key]]
    return values


def write_recipe(tmp_path, drop=(), **changes) -> Path:
    values = {k: v for k, v in _smoke_values().items() if k not in drop}
    values.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def raises(path, *fragments, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    for fragment in (str(path), *fragments):
        assert fragment in message, message
    return message


def test_smoke_recipe_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the file are relative to the file
    recipe = load_recipe(RECIPES_DIR / "smoke.yaml")
    assert Path(recipe.model.model_config).is_dir()
    assert all(Path(f).is_file() for f in recipe.data.data_files)


def test_unknown_key(tmp_path):
    raises(write_recipe(tmp_path, learnig_rate=1e-3), "'learnig_rate'", "did you mean 'learning_rate'")


@pytest.mark.parametrize("key,value,expected", [
    ("learning_rate", "fast", "a number"),
    ("max_steps", 1.5, "an integer"),
    ("bf16", "maybe", "true or false"),
    ("data_files", "one.jsonl", "a list"),
    ("lr_scheduler_type", "cosinus", "'cosine'"),
    ("forge_rounding", "up", "'stochastic'"),
])
def test_wrong_type(tmp_path, key, value, expected):
    raises(write_recipe(tmp_path, **{key: value}), f"key '{key}'", repr(value), expected)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = write_recipe(tmp_path)
    path.write_text(path.read_text().replace("learning_rate: 0.003", "learning_rate: 2e-5"))
    assert load_recipe(path).training.learning_rate == 2e-5  # YAML 1.1 reads 2e-5 as a string


@pytest.mark.parametrize("key,value,expected", [
    ("data_files", ["missing.jsonl"], "matches no file"),
    ("tokenizer_name_or_path", "./no_tokenizer_here", "does not exist"),
    ("model_config", "/nowhere/config.json", "does not exist"),
])
def test_missing_file(tmp_path, key, value, expected):
    raises(write_recipe(tmp_path, **{key: value}), key, expected)


def test_missing_recipe_file(tmp_path):
    raises(tmp_path / "absent.yaml", "does not exist")


@pytest.mark.parametrize("changes,drop,fragments", [
    ({"model_name_or_path": "Qwen/Qwen3-0.6B"}, (), ["model_name_or_path", "model_config", "exactly one"]),
    ({}, ("data_files",), ["dataset_source: local needs data_files"]),
    ({"dataset_source": "hub"}, (), ["data_files", "dataset_source"]),
    ({"optim": "adamw_torch"}, (), ["forge_backend", "optim='adamw_torch'"]),
    ({"gradient_accumulation_steps": 4}, (), ["gradient_accumulation_steps=4", "per_device_train_batch_size"]),
    ({"eval_rows": 0}, (), ["eval_strategy='steps'", "eval_rows"]),
    ({}, ("max_steps",), ["max_steps=-1"]),
    ({"optim_args": "backend=auto"}, (), ["backend is set twice", "forge_backend"]),
    ({"text_template": "{problem} {answer}"}, (), ["text_template", "'answer'"]),
])
def test_impossible_combination(tmp_path, changes, drop, fragments):
    raises(write_recipe(tmp_path, drop=drop, **changes), *fragments)


def test_duplicate_key_and_non_mapping(tmp_path):
    path = write_recipe(tmp_path)
    path.write_text(path.read_text() + "max_steps: 3\n")
    raises(path, "'max_steps' appears twice")
    path.write_text("- a list\n")
    raises(path, "mapping")


def test_command_line_overrides_win(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path), ["--learning_rate", "1e-5", "--max_steps", "7",
                                                  "--forge_include", "q_proj", "v_proj",
                                                  "--forge_stop_on_nonfinite", "true",
                                                  "--forge_recompute_swiglu", "true"])
    assert (recipe.training.learning_rate, recipe.training.max_steps) == (1e-5, 7)
    options = forge_options(recipe.training)
    assert options.patch["include"] == ["q_proj", "v_proj"] and options.stop_on_nonfinite
    assert options.recompute_swiglu and "recompute_swiglu" not in options.patch


@pytest.mark.parametrize("overrides,fragment", [
    (["--learning_rate", "fast"], "--learning_rate"),
    (["--learnig_rate", "1"], "--learnig_rate"),
    (["learning_rate=1e-5"], "learning_rate=1e-5"),
])
def test_bad_override(tmp_path, overrides, fragment):
    raises(write_recipe(tmp_path), fragment, overrides=overrides)
