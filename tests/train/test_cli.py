"""The command line: `forge-hf --help` without torch, the forge optimizer names registered
by `import forge_hf` whichever of forge_hf, transformers and TRL comes first, and every
refusal of `forge-hf train` as one line, exit code 2 and no output directory."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import forge_hf
from forge_hf.train import cli
from forge_hf.train.arguments import recipe_parser
from tests.train.test_recipes import _smoke_values, write_recipe


def _python(code: str, timeout=300) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------ start-up


@pytest.mark.slow
def test_help_and_import_leave_torch_unloaded():
    out = _python("""
        import sys
        import forge_hf
        from forge_hf.train.cli import main
        assert main(["--help"]) == 0 and main(["--version"]) == 0
        print("LOADED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    assert "forge-hf train RECIPE.yaml" in out and f"forge-hf {forge_hf.__version__}" in out
    assert "LOADED []" in out


ORDERS = {
    "forge_hf first, then ForgeTrainer": """
        import forge_hf
        from forge_hf import ForgeTrainer
        from transformers import HfArgumentParser, TrainingArguments
        args, = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", OUT, "--optim", "forge_lion"])
        print("OPTIM", args.optim.value, TrainingArguments(OUT, optim="forge_adamw").optim.value)
    """,
    "the transformers module first": """
        import transformers
        import forge_hf
        print("OPTIM", transformers.TrainingArguments(OUT, optim="forge_lion").optim.value,
              transformers.TrainingArguments(OUT, optim="forge_adamw").optim.value)
    """,
    "transformers first": """
        from transformers import TrainingArguments
        import forge_hf
        print("OPTIM", TrainingArguments(OUT, optim="forge_lion").optim.value,
              TrainingArguments(OUT, optim="forge_adamw").optim.value)
    """,
    "forge_hf, then Trainer, then the call": """
        import forge_hf
        from transformers import Trainer, TrainingArguments
        forge_hf.register_optimizer_names()
        assert Trainer.get_optimizer_cls_and_kwargs.forge_refusal  # a plain Trainer points to ForgeTrainer
        print("OPTIM", TrainingArguments(OUT, optim="forge_lion").optim.value,
              TrainingArguments(OUT, optim="forge_adamw").optim.value)
    """,
    "forge_hf first, then TrainingArguments and nothing else": """
        import forge_hf
        from transformers import Trainer, TrainingArguments
        assert Trainer.get_optimizer_cls_and_kwargs.forge_refusal  # a plain Trainer points to ForgeTrainer
        print("OPTIM", TrainingArguments(OUT, optim="forge_lion").optim.value,
              TrainingArguments(OUT, optim="forge_adamw").optim.value)
    """,
    "forge_hf first, then TRL's config": """
        import forge_hf
        import trl
        print("OPTIM", trl.SFTConfig(OUT, optim="forge_lion", bf16=False).optim.value,
              trl.SFTConfig(OUT, optim="forge_adamw", bf16=False).optim.value)
    """,
    "TRL first, then forge_hf": """
        from trl import SFTConfig
        import forge_hf
        print("OPTIM", SFTConfig(OUT, optim="forge_lion", bf16=False).optim.value,
              SFTConfig(OUT, optim="forge_adamw", bf16=False).optim.value)
    """,
}


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
def test_import_forge_hf_registers_the_optimizer_names(order, tmp_path):
    out = _python(ORDERS[order].replace("OUT", repr(str(tmp_path / "out"))))
    assert "OPTIM forge_lion forge_adamw" in out


def test_public_names_resolve_on_first_use():
    assert set(forge_hf.__all__) == set(forge_hf._PUBLIC) | {"__version__"}
    from forge_hf.optim import distributed
    from forge_hf.optim.patch import patch_model

    assert forge_hf.patch_model is patch_model and forge_hf.distributed is distributed
    assert all(getattr(forge_hf, name) is not None for name in forge_hf.__all__)
    assert set(forge_hf.__all__) <= set(dir(forge_hf))
    with pytest.raises(AttributeError, match="no attribute 'patch_modle'"):
        forge_hf.patch_modle  # noqa: B018


@pytest.mark.slow
def test_train_help_lists_the_recipe_groups_before_torch_loads():
    out = _python("""
        import sys
        from forge_hf.train import arguments, cli

        def recipe_parser():  # where TrainingArguments' fields would load
            print("LOADED", sorted(m for m in ("torch", "transformers.training_args") if m in sys.modules))
            raise SystemExit(0)

        arguments.recipe_parser = recipe_parser
        cli.main(["train", "--help"])
    """)
    assert "--forge_state_precision" in out and "--model_config" in out and "--block_size" in out
    assert out.rstrip().endswith("LOADED []")


def test_train_help_lists_every_key_the_recipe_groups_first(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    listed = set(re.findall(r"^  (--\w+)", out, flags=re.MULTILINE))
    assert listed == {a.option_strings[0] for a in recipe_parser()._actions if a.dest != "help"}  # and -h, --help
    headings = [line for line in out.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert headings[-4:] == ["model:", "data:", "forge:", "training (TrainingArguments' fields):"]
    assert out.index("--forge_lean_loss") < out.index("--output_dir")


@pytest.mark.parametrize("argv", [[], ["--max_steps", "3"]], ids=["nothing", "override_first"])
def test_train_without_a_recipe_is_a_usage_error(capsys, argv):
    assert cli.main(["train", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("forge-hf train: error: no recipe given: usage: forge-hf train RECIPE.yaml [--key value "
                            "...] (`forge-hf train --help` lists every recipe key)\n")


@pytest.mark.slow
def test_python_m_forge_hf_train_without_a_recipe_exits_2_and_help_0():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    bare = subprocess.run([sys.executable, "-m", "forge_hf.train"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert (bare.returncode, bare.stdout) == (2, "")
    assert bare.stderr.startswith("python -m forge_hf.train: error: no recipe given: usage: python -m "
                                  "forge_hf.train RECIPE.yaml") and bare.stderr.count("\n") == 1, bare.stderr
    helped = subprocess.run([sys.executable, "-m", "forge_hf.train", "--help"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert helped.returncode == 0 and "--forge_state_precision" in helped.stdout and "--output_dir" in helped.stdout


def test_train_help_explains_the_forge_keys(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help texts
    for key, words in [("--forge_state_precision", "Optimizer-state storage"),
                       ("--forge_backend", "What runs the fused step"),
                       ("--forge_cuda_graph", "CUDA graph"),
                       ("--forge_min_params", "stay on the ordinary optimizer")]:
        assert key in out and words in out, key
    optim_args = out[out.index("--optim_args OPTIM_ARGS"):]
    assert "state_precision, rounding, backend" in optim_args[:1500]


# ------------------------------------------------------------------ refusals


def _refused(capsys, tmp_path, recipe, *fragments, overrides=(), model_loads=False):
    out = tmp_path / "out"
    assert cli.main(["train", str(recipe), "--output_dir", str(out), *overrides]) == 2
    stderr = capsys.readouterr().err  # after the model loads, its progress bars come first
    error = stderr.rstrip("\n").rpartition("\n")[2]
    assert error.startswith("forge_hf.train: error: ") and "Traceback" not in stderr, stderr
    assert model_loads or stderr == error + "\n", stderr  # before loading, the error alone
    for fragment in (str(recipe), *fragments):
        assert fragment in error, error
    assert not out.exists()  # nothing left behind


@pytest.mark.parametrize("changes,fragments", [
    ({"forge_state_precision": "int4"}, ["forge_state_precision", "'int4'", "'al8'"]),
    ({"dtype": "float16"}, ["dtype='float16'", "dtype: bfloat16", "dtype: float32 with bf16: true"]),
    ({"optim": "forge_adamm"}, ["optim='forge_adamm'", "did you mean 'forge_adamw'"]),
    ({"optim_args": "momentum=0.9"}, ["unknown optim_args key 'momentum'"]),
    ({"learning_rate": -1e-3}, ["learning_rate=-0.001 is negative", "use a positive learning_rate"]),
    ({"train_sampling_strategy": "group_by_length"}, ["train_sampling_strategy='group_by_length'", "remove the key"]),
])
def test_a_bad_value_stops_before_the_model_loads(capsys, tmp_path, changes, fragments):
    _refused(capsys, tmp_path, write_recipe(tmp_path, **changes), *fragments)


def test_triton_without_a_gpu_stops(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(capsys, tmp_path, write_recipe(tmp_path), "forge_backend='triton'", "no CUDA GPU", "reference",
             overrides=["--forge_backend", "triton"])


def test_an_empty_recipe_stops(capsys, tmp_path):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("")
    _refused(capsys, tmp_path, recipe, "the file is empty")


def test_resume_true_without_a_checkpoint_stops(capsys, tmp_path):
    _refused(capsys, tmp_path, write_recipe(tmp_path), "resume_from_checkpoint: true", "holds none",
             overrides=["--resume_from_checkpoint", "true"])


def test_a_patch_refusal_after_loading_stops_the_same_way(capsys, tmp_path):
    # only the loaded model knows its module names; the run still ends in one line, no directory
    _refused(capsys, tmp_path, write_recipe(tmp_path, forge_include=["no_such_proj"]), "'no_such_proj'",
             "matches no linear module", model_loads=True)


def test_float16_weights_loaded_by_dtype_auto_stop(capsys, tmp_path):
    # dtype: auto takes the checkpoint's dtype, known only once the model is loaded
    checkpoint = tmp_path / "fp16_model"
    config = AutoConfig.from_pretrained(_smoke_values()["model_config"])
    AutoModelForCausalLM.from_config(config).half().save_pretrained(checkpoint)
    capsys.readouterr()  # save_pretrained's progress bar
    recipe = write_recipe(tmp_path, drop=("model_config",), model_name_or_path=str(checkpoint), dtype="auto")
    _refused(capsys, tmp_path, recipe, "dtype='auto' loads float16 weights", "dtype: bfloat16", model_loads=True)
