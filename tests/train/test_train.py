"""The smoke recipe end to end, as a user runs it: `accelerate launch -m forge_hf.train`
and the `forge-hf train` console script (also resuming, past the data's end and after a run
killed in the middle of a save), each in a subprocess; what a run prints and leaves in
output_dir. Resuming a user's stream that ended and began again warns."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

import forge_hf
from forge_hf.integrations.checkpoints import check_checkpoint
from forge_hf.integrations.trainer import ForgeTrainer
from forge_hf.train import cli
from forge_hf.train import run as train
from forge_hf.train.report import print_summary
from tests.helpers import ROOT, WORKERS
from tests.integrations.test_trainer import dataset, training_args
from tests.optim.test_optimizer import tiny_llama

SMOKE = ROOT / "recipes" / "smoke.yaml"


def _script(name: str) -> str:
    """A console script of this interpreter's environment."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"the {name} console script is not installed (pip install -e .)")
    return found


def _run(command, tmp_path, timeout=300, returncode=0, **env):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # this checkout's forge_hf
               OMP_NUM_THREADS="1", **env)  # one thread per process: 2-core CI machines run tests side by side
    env.pop("TRITON_INTERPRET", None)  # the smoke recipe uses the reference backend
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == returncode, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _check_output_dir(out: Path, steps: int, micro_batches: int = 1):
    summary = json.loads((out / "forge_summary.json").read_text())
    tokens_per_step = micro_batches * 4 * 128  # micro-batches of 4 blocks of 128 tokens, every one full
    assert summary["steps"] == steps
    assert summary["tokens"] == steps * tokens_per_step
    assert summary["tokens_per_second"] == pytest.approx(summary["steps_per_second"] * tokens_per_step)
    model = AutoModelForCausalLM.from_pretrained(out)
    # every linear is fused; fp32 weights: 4 bytes of gradient each, AdamW's two fp32 moments
    # as large as forge's fp32 states, so the saving is the gradients alone
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert summary["forge_gradient_bytes_never_allocated"] == 4 * weights
    assert summary["adamw_state_bytes"] == summary["forge_state_bytes"] == 2 * 4 * weights
    assert summary["forge_bytes_saved_vs_adamw"] == 4 * weights
    report = (out / "forge_report.txt").read_text()
    assert report.startswith("forge patch: 15 modules fused") and "model.layers.1.mlp.down_proj" in report
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("What is $12 + 30$?\n\nWe add the two numbers: $12 + 30 = 42$.")["input_ids"]])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < summary["first_loss"]  # the saved weights are the trained ones
    return summary


@pytest.mark.slow
def test_smoke_recipe_under_accelerate_launch(tmp_path):
    out = tmp_path / "smoke"
    done = _run([_script("accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no",
                 "-m", "forge_hf.train", str(SMOKE), "--output_dir", str(out)], tmp_path)
    assert "forge_hf.train summary" in done.stdout
    summary = _check_output_dir(out, steps=60)
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary
    assert summary["last_eval_loss"] < summary["first_loss"]
    headline = (out / "forge_report.txt").read_text().partition("\n")[0]
    assert headline in done.stdout.splitlines()  # printed at the start
    assert done.stdout.index(headline) < done.stdout.index("forge_hf.train summary")
    for words in ("steps/s", "tokens/s", "less than AdamW on the fused weights", "loss.png"):
        assert words in done.stdout, words
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # train and eval curves
    assert (out / "checkpoint-60" / "optimizer.pt").is_file()  # a checkpoint with the fused states
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert all(e["forge_nonfinite_tiles"] == 0 for e in history if "loss" in e)


def _logged_training(out: Path) -> list[dict]:
    """The training logs, less what depends on the time."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in e.items() if "per_second" not in k and k != "train_runtime"}
            for e in history if "loss" in e]


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["auto", "false"])
def test_smoke_recipe_through_the_console_script_and_resumed_past_the_datas_end(tmp_path, graph):
    if graph == "false" and not torch.cuda.is_available():
        pytest.skip("no CUDA graph on the CPU: every step is eager, as in the 'auto' case")
    out = tmp_path / "console"
    # 100 training rows pack into 42 blocks, 5.25 steps of 2 micro-batches of 4: checkpoint-10 lies in
    # the second pass over the data, and a step spans each pass's end. The Trainer counts the tokens
    # it trains too (num_input_tokens_seen), to check the summary's. A log line every step: a
    # difference names the first step it shows in. On a GPU 'auto' runs the Triton kernel, which a
    # graph captures (the recipe's reference backend reads the GPU on the host, so it runs eagerly):
    # the resumed run's first two steps are eager where the straight run replays its graph
    graphed = graph == "auto" and torch.cuda.is_available()
    command = [_script("forge-hf"), "train", str(SMOKE), "--max_steps", "20", "--eval_strategy", "no",
               "--save_steps", "10", "--eval_rows", "300", "--gradient_accumulation_steps", "2",
               "--include_num_input_tokens_seen", "true", "--logging_steps", "1", "--forge_cuda_graph", graph,
               *(["--forge_backend", "triton"] if graphed else [])]
    straight_run = _run([*command, "--output_dir", str(out)], tmp_path)
    summary = _check_output_dir(out, steps=20, micro_batches=2)
    assert summary["last_loss"] < summary["first_loss"], summary
    assert summary["tokens"] == json.loads((out / "trainer_state.json").read_text())["num_input_tokens_seen"]

    # resume a copy that holds only checkpoint-10: `true` must find it and train steps 11-20
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-10", resumed / "checkpoint-10")
    done = _run([*command, "--output_dir", str(resumed), "--resume_from_checkpoint", "true"], tmp_path)
    assert "10 after resuming from" in done.stdout
    summary = json.loads((resumed / "forge_summary.json").read_text())
    assert (summary["resumed_from"], summary["steps_this_run"]) == (str(resumed / "checkpoint-10"), 10)
    # the totals count every step; the rates are over this run's steps and tokens, in its time
    assert (summary["tokens"], summary["tokens_this_run"]) == (20 * 8 * 128, 10 * 8 * 128)
    assert summary["tokens_per_second"] == pytest.approx(summary["tokens_this_run"] / summary["train_seconds"])
    assert summary["steps_per_second"] == pytest.approx(10 / summary["train_seconds"])
    assert "tokens      20,480, 10,240 after resuming (" in done.stdout
    for run in (straight_run, done):  # 'auto' replayed a graph
        assert not graphed or "training steps run eagerly" not in run.stderr, run.stderr[-2000:]
    # the same run, bit for bit: the same blocks after the resume, in the second pass as in the
    # first, and the same steps whether eager or replayed. The Triton kernel adds its tiles'
    # squared sums with atomics, in no fixed order: the logged norm to fp32 round-off there
    logged, straight_logs = _logged_training(resumed), _logged_training(out)
    assert len(logged) == len(straight_logs) == 20
    for a, b in zip(logged, straight_logs):
        norms = (a.pop("grad_norm"), b.pop("grad_norm"))
        assert a == b, f"step {a['step']} differs: {a} != {b}"
        assert norms[0] == (pytest.approx(norms[1], rel=1e-5) if graphed else norms[1]), (a["step"], norms)
    straight, again = load_file(out / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in straight:
        assert torch.equal(straight[k], again[k]), k


@pytest.mark.slow
def test_a_save_killed_midway_is_skipped_when_resuming(tmp_path):
    out = tmp_path / "killed"
    arguments = [str(SMOKE), "--max_steps", "15", "--eval_strategy", "no", "--save_steps", "5",
                 "--output_dir", str(out)]
    _run([sys.executable, str(WORKERS / "killed_save_script.py"), *arguments], tmp_path, returncode=-signal.SIGKILL,
         KILL_AT="10")
    unfinished = out / "checkpoint-10"
    assert (unfinished / "optimizer.pt").is_file() and not (unfinished / "trainer_state.json").exists()

    done = _run([_script("forge-hf"), "train", *arguments, "--resume_from_checkpoint", "true"], tmp_path)
    assert f"skipping {unfinished}, an unfinished save (no trainer_state.json" in done.stderr
    summary = json.loads((out / "forge_summary.json").read_text())
    assert (summary["resumed_from"], summary["steps_this_run"], summary["steps"]) == (str(out / "checkpoint-5"), 10, 15)
    assert check_checkpoint(unfinished) == str(unfinished)  # written again, whole, over the unfinished one
    assert json.loads((unfinished / "trainer_state.json").read_text())["global_step"] == 10


class Passes(torch.utils.data.IterableDataset):
    """A user's stream of the same examples each pass: endless, or ending after one pass."""

    def __init__(self, examples: list[dict], endless: bool):
        self.examples, self.endless = examples, endless

    def __iter__(self):
        yield from self.examples
        while self.endless:
            yield from self.examples


@pytest.mark.parametrize("endless", [False, True], ids=["ends", "endless"])
def test_resuming_a_stream_that_ended_and_began_again_warns(tmp_path, caplog, single_thread, endless):
    out = tmp_path / "out"
    data = Passes(dataset(6), endless)  # 3 steps of 2 a pass: checkpoint-5 lies in the second
    args = training_args(out, max_steps=5, save_strategy="steps", save_steps=5)
    ForgeTrainer(model=tiny_llama(), args=args, train_dataset=data).train()
    with caplog.at_level(logging.WARNING):
        ForgeTrainer(model=tiny_llama(), args=args, train_dataset=data).train(str(out / "checkpoint-5"))
    warned = [r.getMessage() for r in caplog.records if "ended and began again" in r.getMessage()]
    assert len(warned) == (0 if endless else 1), caplog.text
    for fix in ("make the dataset endless", "map-style (a datasets.Dataset)"):
        assert endless or fix in warned[0]


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
    assert capsys.readouterr().err.startswith("forge-hf: error: unknown command 'trian' (did you mean 'train'?)\n")
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"forge-hf {forge_hf.__version__}\n"


def test_a_resumed_summary_gives_this_runs_tokens_beside_the_total(capsys):
    summary = dict(recipe="r.yaml", output_dir="out", resumed_from="out/checkpoint-10", steps=20, steps_this_run=10,
                   tokens=20 * 512, tokens_this_run=10 * 512, train_seconds=2.0, wall_seconds=3.0,
                   steps_per_second=5.0, steps_per_second_after_first_step=None, tokens_per_second=2560.0,
                   tokens_per_second_after_first_step=None, first_loss=4.0, last_loss=3.0, last_eval_loss=None,
                   host_peak_rss_gib=1.0, forge_bytes_saved_vs_adamw=4096, forge_gradient_bytes_never_allocated=4096,
                   forge_state_bytes=8192, adamw_state_bytes=8192, files=["forge_summary.json"])
    print_summary(summary)
    out = capsys.readouterr().out
    assert "steps       20, 10 after resuming from out/checkpoint-10 (5.0 steps/s)" in out
    assert "tokens      10,240, 5,120 after resuming (2,560.0 tokens/s)" in out
    print_summary({**summary, "resumed_from": None, "steps_this_run": 20, "tokens_this_run": 20 * 512})
    out = capsys.readouterr().out
    assert "steps       20 (5.0 steps/s)" in out and "tokens      10,240 (2,560.0 tokens/s)" in out
