"""benchmarks/convergence.py at tiny settings on CPU (the reference backend): its rows, curves,
plot and quantization report, and that every arm starts from one initialisation and sees
one data order."""

import csv
import json
import math

import pytest
import torch

from tests.helpers import benchmark_module

LRS = (1e-2, 3e-5)  # 1e-2: a tiny model learns visibly within 8 steps
STEPS, EVAL_EVERY, LAYERS = 8, 4, 2
TINY = ["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--hidden", "32", "--layers", str(LAYERS),
        "--vocab", "256", "--topics", "4", "--seq", "16", "--batch", "2", "--eval-sequences", "4",
        "--warmup-steps", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def convergence():
    with benchmark_module("convergence") as module:
        yield module


class Recorder:
    """The tool's ``observe`` hook: each arm's weights as built and every batch it trained on."""

    def __init__(self):
        self.weights, self.batches = {}, {}

    def start(self, arm, lr, model):
        self.weights[arm, lr] = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def batch(self, arm, lr, step, input_ids):
        self.batches.setdefault((arm, lr), []).append(input_ids.clone())


@pytest.fixture(scope="module")
def run(convergence, tmp_path_factory, single_thread):
    out = tmp_path_factory.mktemp("convergence")
    paths = {k: out / f"curves.{k}" for k in ("json", "png", "md", "csv")}
    recorder = Recorder()
    result = convergence.main(TINY + ["--lr", ",".join(map(str, LRS)), "--quantization-report",
                                      "--capture-steps", "2,3,8", "--out", str(paths["json"]),
                                      "--png", str(paths["png"]), "--md", str(paths["md"]),
                                      "--table", str(paths["csv"])], observe=recorder)
    return result, recorder, paths


def test_rows_one_per_arm_and_lr_with_the_final_loss(convergence, run):
    result, _, paths = run
    with paths["csv"].open(newline="") as f:
        rows = list(csv.DictReader(f))
    arms = [*convergence.ARMS, convergence.CAPTURE_ARM]
    assert [(r["arm"], float(r["note"].split("lr=")[1].split(",")[0])) for r in rows] == \
        [(a, lr) for lr in LRS for a in arms]
    finals = {(r["arm"], r["lr"]): r["final_eval_loss"] for r in result["runs"]}
    for r in rows:
        assert r["tool"] == "convergence" and r["batch"] == "2x16"
        assert r["note"].startswith("final_eval_loss=")
        loss = float(r["note"].split("=")[1].split(",")[0])
        lr = float(r["note"].split("lr=")[1].split(",")[0])
        assert loss == pytest.approx(finals[r["arm"], lr], abs=1e-4)
        assert float(r["step_ms"]) > 0 and r["peak_gib"] == ""  # no device memory on CPU


def test_every_arm_starts_from_the_same_weights(run):
    _, recorder, _ = run
    reference = recorder.weights["fp32_master", LRS[0]]
    # a real fp32 initialisation: rounding it to bf16 changes it, so the comparison below has teeth
    assert any(not torch.equal(w, w.bfloat16().float()) for w in reference.values())
    for (arm, lr), weights in recorder.weights.items():
        assert weights.keys() == reference.keys(), arm
        for name, w in weights.items():
            expected = reference[name] if arm == "fp32_master" else reference[name].bfloat16().float()
            assert torch.equal(w, expected), f"{arm} at lr {lr}: {name} differs from the shared initialisation"


def test_every_arm_sees_the_same_batches_in_the_same_order(convergence, run):
    _, recorder, _ = run
    reference = recorder.batches["fp32_master", LRS[0]]
    assert len(reference) == STEPS
    assert not any(torch.equal(a, b) for a, b in zip(reference, reference[1:]))  # the order matters
    assert len(recorder.batches) == len(LRS) * len(convergence.ALL_ARMS)
    for (arm, lr), batches in recorder.batches.items():
        assert len(batches) == STEPS and all(torch.equal(a, b) for a, b in zip(batches, reference)), (arm, lr)


def test_reference_held_out_loss_falls(run):
    result, _, _ = run
    ref = next(r for r in result["runs"] if r["arm"] == "fp32_master" and r["lr"] == max(LRS))
    assert ref["steps"] == [0, 4, 8]
    assert ref["eval_loss"][0] == pytest.approx(math.log(256), abs=0.1)  # an untrained model guesses uniformly
    assert ref["eval_loss"][-1] < ref["eval_loss"][0] - 0.05
    assert all(b < a for a, b in zip(ref["eval_loss"], ref["eval_loss"][1:]))
    assert 0 < result["floor"] < ref["eval_loss"][-1]


def test_curves_json_plot_and_table_and_redrawing_them(convergence, run, tmp_path):
    result, _, paths = run
    saved = json.loads(paths["json"].read_text())
    assert saved["runs"] == result["runs"] and len(saved["runs"]) == len(LRS) * len(convergence.ALL_ARMS)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = paths["md"].read_text()
    assert all(f"| {a} | {lr:g} |" in table for a in convergence.ARMS for lr in LRS)
    assert "| fp32_master | 0.01 | " in table and "+0.00% |" in table
    redrawn = convergence.main(["--curves", str(paths["json"]), "--png", str(tmp_path / "p.png"),
                                "--md", str(tmp_path / "t.md")])
    assert redrawn["runs"] == result["runs"]
    assert (tmp_path / "t.md").read_text() == table
    assert (tmp_path / "p.png").stat().st_size > 0


def test_curves_of_other_data_are_refused(convergence, run, tmp_path):
    _, _, paths = run
    other = json.loads(paths["json"].read_text())
    other["language"]["vocab"] = 512
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another language"):
        convergence.merge_curves([paths["json"], tmp_path / "other.json"])


def test_quantization_report_on_the_captured_moments(convergence, run):
    result, _, _ = run
    rows = result["quantization"]
    fused = 7 * LAYERS + 1  # every projection of every layer, and lm_head
    assert len(rows) == len(LRS) * 3 * len(convergence.REPORT_PRECISIONS) * fused
    assert {r["step"] for r in rows} == {2, 3, 8}
    for r in rows:
        for key in ("e_upd", "e_upd_exp_avg_alone", "e_upd_exp_avg_sq_alone", "rel_l2_exp_avg_sq"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["layer"], key)
    # the 8- and 4-bit precisions lose more than bf16 on real moments
    for precision in ("int8", "al8", "log4", "log4_factored"):
        worse = [r["e_upd"] for r in rows if r["precision"] == precision]
        assert sorted(worse)[len(worse) // 2] > sorted(r["e_upd"] for r in rows if r["precision"] == "bf16")[0]


def test_gradient_from_moments_inverts_adamw_first_moment(convergence):
    gen = torch.Generator().manual_seed(0)
    m, g = torch.randn(64, 32, generator=gen) * 1e-3, torch.randn(64, 32, generator=gen) * 1e-3
    beta1 = convergence.BETAS[0]
    after = m + (1 - beta1) * (g - m)  # the rule's update (core/rules.py)
    torch.testing.assert_close(convergence.gradient_from_moments(m, after), g, rtol=1e-4, atol=1e-9)


def test_language_is_seeded_and_its_floor_is_a_distribution(convergence):
    lang = convergence.TopicMarkovLanguage(vocab=64, topics=3, seed=1)
    x = lang.sample(5, 12, seed=7)
    assert x.dtype == torch.int32 and x.shape == (5, 12) and int(x.max()) < 64
    assert torch.equal(x, convergence.TopicMarkovLanguage(64, 3, seed=1).sample(5, 12, seed=7))
    assert not torch.equal(x, lang.sample(5, 12, seed=8))
    # every next token after one prefix: the source's predictive probabilities sum to 1
    prefixes = x[:1].repeat(64, 1)
    prefixes[:, -1] = torch.arange(64)
    total = lang.log_probs(prefixes)[:, -1].exp().sum()
    assert float(total) == pytest.approx(1.0, abs=1e-9)
    floor = -float(lang.log_probs(lang.sample(64, 32, seed=3)).mean())
    assert 0 < floor < math.log(64) - 1  # the source has structure to learn


@pytest.mark.parametrize("args, message", [
    (["--arms", "fp32_master,adamw8bit"], "unknown arm(s) ['adamw8bit'] in --arms"),
    (["--lr", "3e-5,fast"], "--lr '3e-5,fast' is not a comma-separated list"),
    (["--lr", "0"], "has a learning rate <= 0"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--jobs", "0"], "--jobs 0 must be at least 1"),
    (["--hidden", "96", "--heads", "5"], "--hidden 96 is not divisible by --heads 5"),
    (["--warmup-steps", "50"], "--warmup-steps 50 must be between 1 and --steps 8"),
    (["--capture-steps", "1,4"], "--capture-steps [1] outside 2..--steps 8"),
    (["--curves", "x.json"], "--curves only draws: give --png and/or --md"),
])
def test_bad_options_are_refused_in_one_line(convergence, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        convergence.parse_args(TINY + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_device_without_cuda_is_refused(convergence, capsys):
    with pytest.raises(SystemExit):
        convergence.parse_args(TINY[:-1] + ["cuda"])
    assert "--device cuda but no CUDA device is visible: use --device cpu" in capsys.readouterr().err


def test_jobs_train_each_run_in_a_process_of_its_own_with_the_same_curves(convergence, run, tmp_path):
    """--jobs 2: each (arm, lr) trained by a child process, rows appended by each, curves
    merged in one process's order and equal to one process's."""
    result, _, _ = run
    arms = ("fp32_master", "forge_al8")
    merged = convergence.main(TINY + ["--lr", ",".join(map(str, LRS)), "--arms", ",".join(arms), "--jobs", "2",
                                      "--out", str(tmp_path / "merged.json"), "--table", str(tmp_path / "rows.csv")])
    assert [(r["arm"], r["lr"]) for r in merged["runs"]] == [(a, lr) for lr in LRS for a in arms]
    alone = {(r["arm"], r["lr"]): r["eval_loss"] for r in result["runs"]}
    for r in merged["runs"]:
        assert r["eval_loss"] == pytest.approx(alone[r["arm"], r["lr"]], rel=1e-5)
    with (tmp_path / "rows.csv").open(newline="") as f:
        assert sorted(row["arm"] for row in csv.DictReader(f)) == sorted(arms * len(LRS))
    assert json.loads((tmp_path / "merged.json").read_text())["runs"] == merged["runs"]
    # each process's curves stay beside --out, so a run cut short can still be drawn
    parts = sorted((tmp_path / "merged_parts").glob("*.json"))
    assert [p.name for p in parts] == sorted(f"{a}_{lr:g}.json" for a in arms for lr in LRS)
    assert convergence.merge_curves(parts)["runs"] == sorted(merged["runs"], key=lambda r: f"{r['arm']}_{r['lr']:g}")


def test_jobs_name_the_run_whose_process_failed(convergence, tmp_path):
    with pytest.raises(RuntimeError, match=r"training forge_al8 at lr 0.01 exited with 1"):
        convergence.main(TINY + ["--lr", "1e-2", "--arms", "forge_al8", "--jobs", "2", "--backend", "nonsense",
                                 "--table", str(tmp_path / "rows.csv")])
