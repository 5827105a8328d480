"""The smoke recipe end to end, as a user runs it: `accelerate launch -m forge_hf.train`
and the `forge-hf train` console script, each in a subprocess."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_hf.train import cli
from forge_hf.train import run as train

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes" / "smoke.yaml"


def _script(name: str) -> str:
    """A console script of this interpreter's environment."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"the {name} console script is not installed (pip install -e .)")
    return found


def _run(command, tmp_path, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
               OMP_NUM_THREADS="1")  # one thread per process: 2-core CI machines run tests side by side
    env.pop("TRITON_INTERPRET", None)  # the smoke recipe uses the reference backend
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _check_output_dir(out: Path, steps: int):
    summary = json.loads((out / "forge_summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["tokens"] == steps * 4 * 128  # batch 4 x block 128, every block full
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("What is $12 + 30$?\n\nWe add the two numbers: $12 + 30 = 42$.")["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < summary["first_loss"]  # the saved weights are the trained ones
    return summary


def test_smoke_recipe_under_accelerate_launch(tmp_path):
    out = tmp_path / "smoke"
    done = _run([_script("accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no",
                 "-m", "forge_hf.train", str(SMOKE), "--output_dir", str(out)], tmp_path)
    assert "forge_hf.train summary" in done.stdout
    summary = _check_output_dir(out, steps=60)
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary
    assert summary["last_eval_loss"] < summary["first_loss"]
    assert (out / "checkpoint-60" / "optimizer.pt").is_file()  # a checkpoint with the fused states
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert all(e["forge_nonfinite_tiles"] == 0 for e in history if "loss" in e)


def test_smoke_recipe_through_the_console_script(tmp_path):
    out = tmp_path / "console"
    _run([_script("forge-hf"), "train", str(SMOKE), "--output_dir", str(out), "--max_steps", "20",
          "--eval_strategy", "no", "--save_strategy", "no"], tmp_path)
    summary = _check_output_dir(out, steps=20)
    assert summary["last_loss"] < summary["first_loss"], summary
    assert not list(out.glob("checkpoint-*"))


def test_a_bad_recipe_stops_before_training(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text().replace("learning_rate:", "learnig_rate:"))
    assert train.main([str(bad)]) == 2
    error = capsys.readouterr().err
    assert str(bad) in error and "'learnig_rate'" in error and "did you mean 'learning_rate'" in error


def test_console_script_usage(capsys):
    assert cli.main(["--help"]) == 0
    assert "forge-hf train RECIPE.yaml" in capsys.readouterr().out
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
