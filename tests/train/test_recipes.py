"""Recipes: every bundled one parses; bad ones stop with an error naming the file and key."""

from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainingArguments

from forge_hf.core.config import trainer_keys
from forge_hf.train.arguments import ForgeArguments
from forge_hf.train.recipe import PATH_KEYS, RecipeError, load_recipe
from tests.helpers import write_checkpoint

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
CPT_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "llama-3.1-8b")
# TrainingArguments refuses bf16 on a machine without a bf16 GPU unless use_cpu is set
HARDWARE = [] if torch.cuda.is_available() else ["--use_cpu", "true"]


def test_the_recipe_set_is_complete():
    names = {p.stem for p in RECIPES}
    expected = {f"{m}-cpt-{s}-state" for m in CPT_MODELS for s in ("bf16", "al8")}
    assert expected | {"smoke", "qwen3-1.7b-shape-random-local"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses(path):
    recipe = load_recipe(path, HARDWARE)
    assert recipe.config.optimizer == "adamw"
    assert recipe.training.max_steps > 0


@pytest.mark.parametrize("model", CPT_MODELS)
@pytest.mark.parametrize("state", ["bf16", "al8"])
def test_cpt_recipes_use_the_papers_settings(model, state):
    recipe = load_recipe(RECIPES_DIR / f"{model}-cpt-{state}-state.yaml", HARDWARE)
    t, d = recipe.training, recipe.data
    assert (t.per_device_train_batch_size, d.block_size, t.gradient_accumulation_steps) == (4, 512, 1)
    assert (t.learning_rate, t.warmup_steps, t.weight_decay) == (2e-5, 500, 0.01)
    assert (t.adam_beta1, t.adam_beta2, t.max_grad_norm) == (0.9, 0.999, 0.0)
    assert t.lr_scheduler_type == "cosine" and t.bf16 and t.use_liger_kernel
    assert recipe.model.dtype == "bfloat16"
    assert d.dataset_name == "nvidia/OpenMathInstruct-2" and d.streaming
    # the bf16 recipes keep the default, auto: bf16 states for their bf16 weights
    assert recipe.config.state_precision_for(torch.bfloat16) == state


def test_forge_arguments_cover_forge_trainers_options():
    assert {f.name for f in fields(ForgeArguments)} == {f"forge_{k}" for k in trainer_keys()}


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
    assert recipe.training.train_sampling_strategy == "sequential"  # the blocks in the rows' seeded order


def test_a_negative_learning_rate_on_the_command_line(tmp_path):
    recipe = write_recipe(tmp_path)
    raises(recipe, "learning_rate=-0.001 is negative", "use a positive learning_rate",
           overrides=["--learning_rate=-1e-3"])
    raises(recipe, "--learning_rate", "--key=value for a value starting with '-'",
           overrides=["--learning_rate", "-1e-3"])


def test_unknown_key(tmp_path):
    raises(write_recipe(tmp_path, learnig_rate=1e-3), "'learnig_rate'", "did you mean 'learning_rate'")


@pytest.mark.parametrize("key,value,expected", [
    ("learning_rate", "fast", "a number"),
    ("max_steps", 1.5, "an integer"),
    ("bf16", "maybe", "true or false"),
    ("data_files", "one.jsonl", "a list"),
    ("lr_scheduler_type", "cosinus", "'cosine'"),
    ("forge_rounding", "up", "'stochastic'"),
    ("forge_lean_loss", "maybe", "['auto', 'true', 'false']"),
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
    ({"optim": "adamw_torch"}, (), ["optim='adamw_torch' is not a forge optimizer", "'forge_adamw'"]),
    ({"dtype": "float16"}, (), ["dtype='float16'", "dtype: bfloat16", "bf16: true"]),
    ({"forge_min_params": -1}, (), ["forge_min_params: min_params=-1 is not a count", "use an integer >= 0"]),
    ({"adam_beta1": 1.5}, (), ["betas=(1.5, 0.999)"]),
    ({"eval_rows": 0}, (), ["eval_strategy='steps'", "eval_rows"]),
    ({"torch_compile": True, "use_liger_kernel": True}, (), ["torch_compile=True with use_liger_kernel=True",
                                                            "use_liger_kernel=True without torch_compile"]),
    ({}, ("max_steps",), ["max_steps=-1"]),
    ({"optim_args": "backend=auto"}, (), ["backend is set twice", "forge_backend"]),
    ({"text_template": "{problem} {answer}"}, (), ["text_template", "'answer'"]),
])
def test_impossible_combination(tmp_path, changes, drop, fragments):
    raises(write_recipe(tmp_path, drop=drop, **changes), *fragments)


def test_duplicate_key_non_mapping_and_empty_file(tmp_path):
    path = write_recipe(tmp_path)
    lines = path.read_text().splitlines()
    first = 1 + next(i for i, line in enumerate(lines) if line.startswith("max_steps:"))
    path.write_text(path.read_text() + "max_steps: 3\n")
    message = raises(path, "'max_steps' appears twice")
    assert message == (f"{path}, line {len(lines) + 1}, column 1: not valid YAML: key 'max_steps' appears twice "
                       f"(first on line {first}): keep one")  # one line, located in the file
    path.write_text("max_steps: 3\nforge_include: [q_proj, v_proj\nlearning_rate: 1e-3\n")
    assert raises(path, "not valid YAML").startswith(f"{path}, line 3, column 14: ")
    path.write_text("- a list\n")
    raises(path, "mapping")
    for empty in ("", "# only a comment\n"):
        path.write_text(empty)
        message = raises(path, "the file is empty")
        assert "NoneType" not in message


@pytest.mark.parametrize("key,value,fragments", [
    ("forge_state_precision", "int4", ["'int4'", "'fp32', 'bf16', 'int8', 'al8'"]),
    ("forge_rounding", "nearst", ["did you mean 'nearest'"]),
    ("forge_backend", "cuda", ["'auto', 'triton', 'reference'"]),
    ("forge_data_parallel", "ddp", ["'sharded', 'replicated'"]),
    ("lr_scheduler_type", "cosinus", ["did you mean 'cosine'"]),
])
def test_a_value_outside_its_choices_names_them(tmp_path, key, value, fragments):
    path = write_recipe(tmp_path, **{key: value})
    raises(path, f"key '{key}'", *fragments)
    raises(write_recipe(tmp_path), f"--{key}", *fragments, overrides=[f"--{key}", value])


@pytest.mark.parametrize("optim,suggestion", [
    ("forge_adamm", "forge_adamw"),  # a typo
    ("adamw_torch_fused", "forge_adamw"),  # a transformers name: the forge twin
    ("paged_lion_8bit", "forge_lion"),
    ("sgd", "forge_sgd"),
])
def test_an_unknown_optim_gets_the_closest_forge_name(tmp_path, optim, suggestion):
    in_file = raises(write_recipe(tmp_path, optim=optim), f"optim={optim!r}", f"did you mean {suggestion!r}")
    on_command_line = raises(write_recipe(tmp_path), f"optim={optim!r}", f"did you mean {suggestion!r}",
                             overrides=["--optim", optim])
    for message in (in_file, on_command_line):
        assert "adamw_torch" not in message.replace(optim, "")  # not transformers' list of names
        assert "\n" not in message


def test_forge_options_in_optim_args_are_checked_too(tmp_path):
    path = write_recipe(tmp_path, drop=("forge_state_precision",), optim_args="state_precision=int4")
    raises(path, "optim_args state_precision", "'int4'", "'al8'")
    path = write_recipe(tmp_path, drop=("forge_state_precision",), optim_args="rounding=up")
    raises(path, "optim_args rounding", "'up'", "'nearest'")


def test_triton_backend_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' CPU stand-in for a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = raises(write_recipe(tmp_path, forge_backend="triton"), "forge_backend='triton'", "no CUDA GPU",
                     "auto", "reference")
    assert "\n" not in message
    raises(write_recipe(tmp_path, drop=("forge_backend",), optim_args="backend=triton"), "optim_args backend")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_recipe(write_recipe(tmp_path, forge_backend="triton")).forge.forge_backend == "triton"


# transformers 5.2x renamed gradient_checkpointing (a deprecated alias now)
CHECKPOINTING = next(k for k in ("activation_checkpointing", "gradient_checkpointing")
                     if k in {f.name for f in fields(TrainingArguments)})


@pytest.mark.parametrize("changes,reason", [
    ({"forge_stop_on_nonfinite": True}, "stop_on_nonfinite"),
    ({CHECKPOINTING: True}, "activation checkpointing"),
    ({"use_cpu": True}, "not be on a CUDA device"),
])
def test_cuda_graph_true_where_no_step_can_be_captured(tmp_path, changes, reason):
    raises(write_recipe(tmp_path, forge_cuda_graph=True, **changes), "forge_cuda_graph=true", reason, "auto")


def test_yaml_booleans_for_true_false_choices(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, forge_cuda_graph=False))
    assert recipe.forge.forge_cuda_graph == "false" and recipe.config.cuda_graph == "false"


def _checkpoint(output_dir: Path, step: int) -> Path:
    return write_checkpoint(output_dir / f"checkpoint-{step}")


@pytest.mark.parametrize("given", [["--resume_from_checkpoint", "true"], ["--resume_from_checkpoint", "True"], "yaml"])
def test_resume_true_finds_the_latest_checkpoint(tmp_path, given):
    out = tmp_path / "out"
    for step in (5, 40, 10):  # by step number, not name order or age
        _checkpoint(out, step)
    if given == "yaml":
        recipe = load_recipe(write_recipe(tmp_path, output_dir=str(out), resume_from_checkpoint=True))
    else:
        recipe = load_recipe(write_recipe(tmp_path, output_dir=str(out)), given)
    assert recipe.training.resume_from_checkpoint == str(out / "checkpoint-40")


def test_resume_false_and_a_path(tmp_path):
    out = tmp_path / "out"
    assert load_recipe(write_recipe(tmp_path, output_dir=str(out), resume_from_checkpoint=False)
                       ).training.resume_from_checkpoint is None
    path = str(_checkpoint(out, 7))
    recipe = load_recipe(write_recipe(tmp_path), ["--resume_from_checkpoint", path])
    assert recipe.training.resume_from_checkpoint == path


def test_resume_without_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    path = write_recipe(tmp_path, output_dir=str(out))
    raises(path, "resume_from_checkpoint: true", str(out), "holds none", overrides=["--resume_from_checkpoint", "true"])
    (out / "checkpoint-3").mkdir(parents=True)  # an empty directory is no checkpoint
    for given in (str(out / "checkpoint-3"), "true"):
        raises(path, "resume_from_checkpoint=", "trainer_state.json", overrides=["--resume_from_checkpoint", given])
    raises(path, "resume_from_checkpoint=", "does not exist", overrides=["--resume_from_checkpoint", str(out / "nope")])


def test_command_line_overrides_win(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path), ["--learning_rate", "1e-5", "--max_steps", "7",
                                                  "--forge_include", "q_proj", "v_proj",
                                                  "--forge_stop_on_nonfinite", "true",
                                                  "--forge_recompute_swiglu", "true"])
    assert (recipe.training.learning_rate, recipe.training.max_steps) == (1e-5, 7)
    config = recipe.config
    assert config.include == ("q_proj", "v_proj") and config.stop_on_nonfinite and config.recompute_swiglu == "true"


def test_forge_lean_loss_reaches_the_config(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, forge_lean_loss=True))
    assert recipe.config.lean_loss == "true" and not recipe.training.optim_args  # never serialised into optim_args
    assert load_recipe(write_recipe(tmp_path), ["--forge_lean_loss", "false"]).config.lean_loss == "false"
    assert load_recipe(write_recipe(tmp_path)).config.lean_loss == "auto"  # unset: where it applies


def test_forge_lean_loss_refusals(tmp_path):
    """Liger's fused linear cross-entropy (the CPT recipes') and label smoothing, in the file
    or inside optim_args; Liger's other kernels without its loss are fine."""
    raises(write_recipe(tmp_path, forge_lean_loss=True, use_liger_kernel=True),
           "forge_lean_loss=true with use_liger_kernel=True", "set lean_loss=false",
           "'fused_linear_cross_entropy': False")
    raises(write_recipe(tmp_path, optim_args="lean_loss=true", use_liger_kernel=True),
           "optim_args lean_loss=true with use_liger_kernel=True")
    raises(write_recipe(tmp_path, forge_lean_loss=True, label_smoothing_factor=0.1),
           "forge_lean_loss=true with label_smoothing_factor=0.1")
    recipe = load_recipe(write_recipe(tmp_path, forge_lean_loss=True, use_liger_kernel=True,
                                      liger_kernel_config={"fused_linear_cross_entropy": False}))
    assert recipe.config.lean_loss == "true"


@pytest.mark.parametrize("overrides,fragment", [
    (["--learning_rate", "fast"], "--learning_rate"),
    (["--learnig_rate", "1"], "--learnig_rate"),
    (["learning_rate=1e-5"], "learning_rate=1e-5"),
])
def test_bad_override(tmp_path, overrides, fragment):
    raises(write_recipe(tmp_path), fragment, overrides=overrides)


def test_tp_plan_loads_pretrained_weights_split(monkeypatch):
    """tp_plan reaches from_pretrained; with only a model_config (built whole, at random) it is refused."""
    from forge_hf.train import run
    from forge_hf.train.arguments import ModelArguments

    with pytest.raises(ValueError, match=r"^tp_plan='auto' splits pretrained weights as they load: set "
                                         r"model_name_or_path .*or drop tp_plan$"):
        ModelArguments(model_config="some/config", tp_plan="auto")
    seen = {}
    monkeypatch.setattr(run.AutoModelForCausalLM, "from_pretrained", lambda name, **kw: seen.update(kw, name=name))
    run.build_model(ModelArguments(model_name_or_path="some/model", tp_plan="auto"), seed=0)
    assert seen["tp_plan"] == "auto" and seen["name"] == "some/model"
