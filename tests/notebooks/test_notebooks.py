"""Every notebook in notebooks/ runs top to bottom on CPU with tiny parameters, offline.

Parameters are injected papermill-style: a code cell tagged ``injected-parameters`` is
inserted right after the cell tagged ``parameters``, so its assignments win and the rest of
the notebook runs unchanged. The kernel is a spec written for this interpreter
(``sys.executable``) into a temporary JUPYTER_PATH, so the notebooks run in pytest's own
environment whatever other ``python3`` kernels the machine has.
"""

import ast
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SMOKE = ROOT / "forge_hf" / "assets" / "smoke"
KERNEL = "forge-hf-tests"

pytestmark = pytest.mark.slow  # notebook kernels and install cells run in child processes

# the tiny stand-ins for the Colab defaults: a 2-layer Llama from a config, the bundled
# tokenizer and mini-corpus, a few steps on the pure-PyTorch backend
TINY_FINETUNE = dict(
    model_id=str(SMOKE / "llama_tiny"), from_config=True, tokenizer_id=str(SMOKE / "tokenizer"),
    dataset=str(SMOKE / "omi2_mini.jsonl"), prompt_column="problem", response_column="generated_solution",
    max_rows=48, max_length=96, max_steps=3, batch_size=4, learning_rate=1e-3, precision="fp32",
    max_new_tokens=8,
)


def cpt_state_precision() -> str:
    """8-bit state where forge_hf has it, else bf16."""
    from forge_hf.core.config import STATE_PRECISIONS

    return "al8" if "al8" in STATE_PRECISIONS else "bf16"


def tiny_parameters(name: str, tmp_path: Path) -> dict:
    if name == "01_full_finetune_forge_adamw.ipynb":
        return dict(TINY_FINETUNE, optim_args="state_precision=fp32,backend=reference", compare_steps=3)
    if name == "02_lora_peft_forge.ipynb":
        return dict(TINY_FINETUNE, lora_r=4, lora_alpha=8, state_precision="fp32", backend="reference")
    if name == "03_continued_pretraining_recipe.ipynb":
        return dict(recipe=str(ROOT / "recipes" / "smoke.yaml"), state_precision=cpt_state_precision(),
                    max_steps=3, batch_size=2, block_size=64, backend="reference", logging_steps=1,
                    extra_overrides=["--eval_steps", "2", "--eval_rows", "8"], compare_state_precision="fp32")
    if name == "04_benchmark_results.ipynb":
        return dict(results_csv=str(benchmark_results(tmp_path)))
    if name == "05_sft_variable_length.ipynb":
        return dict(TINY_FINETUNE, optim_args="state_precision=fp32,backend=reference", compare_steps=3)
    raise AssertionError(f"{name} has no tiny parameters: add them to tests/notebooks/test_notebooks.py")


def benchmark_results(tmp_path: Path) -> Path:
    """The committed results table, plus made-up rows of a later run on another GPU (a
    faster arm and an out-of-memory one), away from benchmarks/: the notebook then finds
    report.py in the checkout."""
    table = tmp_path / "results" / "results.csv"
    table.parent.mkdir()
    table.write_text((ROOT / "benchmarks" / "results" / "results.csv").read_text())
    with table.open(newline="") as f:
        columns = csv.DictReader(f).fieldnames
    run = dict(date="2099-01-01", commit="made-up", gpu="made-up GPU", torch="0", triton="0", transformers="0",
               model="llama-3.1-8b", batch="1x512", tool="run_grid")
    with table.open("a", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writerow(dict(run, arm="forge_bf16_graphed", step_ms=80.0, spread_ms=1.0, peak_gib=46.0, note="round 0"))
        writer.writerow(dict(run, arm="made_up_arm", peak_gib=139.0, note="round 0, OOM"))
    return table


def install_cell(nb) -> str:
    installs = [c.source for c in nb.cells if c.cell_type == "code" and "pip" in c.source and "install" in c.source]
    assert len(installs) == 1, f"{len(installs)} install cells: a notebook needs exactly one"
    return installs[0]


def parameters_cell(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters': a notebook needs exactly one"
    return tagged[0]


def inject(nb, parameters: dict) -> None:
    """Insert the injected-parameters cell after the parameters cell (papermill's layout)."""
    index = parameters_cell(nb)
    assigned = {t.id for node in ast.parse(nb.cells[index].source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    unknown = sorted(set(parameters) - assigned)
    assert not unknown, f"{unknown} are not assigned in the parameters cell (it assigns {sorted(assigned)})"
    source = "# Injected parameters\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(index + 1, cell)


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / KERNEL)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # offline, caches in the test's folder; the kernel inherits this environment
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # no display needed: figures are not kept
    return tmp_path


def test_notebooks_found():
    assert [p.name for p in NOTEBOOKS] == [
        "01_full_finetune_forge_adamw.ipynb", "02_lora_peft_forge.ipynb",
        "03_continued_pretraining_recipe.ipynb", "04_benchmark_results.ipynb", "05_sft_variable_length.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean(path):
    """Valid nbformat 4, outputs cleared, one parameters cell, one install cell."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    parameters_cell(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name}: clear the outputs"
    install_cell(nb)


def test_install_cell_is_the_same_in_every_notebook():
    cells = {p.name: install_cell(nbformat.read(p, as_version=4)) for p in NOTEBOOKS}
    assert len(set(cells.values())) == 1, f"the install cells differ: make {sorted(cells)} agree"


# `python -m pip` in the cell's subprocess finds this module first (PYTHONPATH): it records
# its arguments and exits with FAKE_PIP_EXIT, so nothing is installed and nothing is fetched
FAKE_PIP = """import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(int(os.environ["FAKE_PIP_EXIT"]))
"""


def run_install_cell(tmp_path, *, installed: bool, pip_exit: int = 0, wheels=()):
    """The install cell's code in a fresh interpreter whose working directory (the notebook's
    folder) holds `wheels`; with installed=False forge_hf does not import there. Returns the
    finished process, pip's calls and what the folder holds afterwards."""
    (tmp_path / "fake" / "pip").mkdir(parents=True)
    (tmp_path / "fake" / "pip" / "__init__.py").write_text("")
    (tmp_path / "fake" / "pip" / "__main__.py").write_text(FAKE_PIP)
    folder = tmp_path / "notebook"
    folder.mkdir()
    for age, name in enumerate(reversed(wheels)):  # the last one named is the newest
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (1e9 - age, 1e9 - age))
    hide = "" if installed else "import sys; sys.modules['forge_hf'] = None  # find_spec: None\n"
    source = hide + install_cell(nbformat.read(NOTEBOOKS[0], as_version=4))
    log = tmp_path / "pip_calls.jsonl"
    env = {**os.environ, "FAKE_PIP_LOG": str(log), "FAKE_PIP_EXIT": str(pip_exit), "PIP_NO_INDEX": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "fake"), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", source], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls, sorted(p.name for p in folder.iterdir())


def test_install_cell_does_nothing_when_forge_hf_imports(tmp_path):
    done, calls, left = run_install_cell(tmp_path, installed=True)
    assert done.returncode == 0, done.stderr
    assert calls == [] and left == [] and done.stdout == ""


def test_install_cell_installs_the_newest_wheel_next_to_the_notebook(tmp_path):
    wheels = ("forge_hf-0.1.0-py3-none-any.whl", "forge_hf-0.1.1-py3-none-any.whl")
    done, calls, left = run_install_cell(tmp_path, installed=False, wheels=wheels)
    assert done.returncode == 0, done.stderr
    assert calls == [["install", "-q", "forge_hf-0.1.1-py3-none-any.whl"]]


def test_install_cell_without_index_or_wheel_names_both_ways(tmp_path):
    done, calls, left = run_install_cell(tmp_path, installed=False, pip_exit=1)
    assert calls == [["install", "-q", "forge-hf"]], "the distribution is installed by its name"
    assert done.returncode != 0 and left == [], "nothing may be installed or left behind"
    message = done.stderr.strip().splitlines()
    assert message[-3].startswith("RuntimeError: pip could not install forge-hf"), done.stderr
    assert message[-2].strip() == "- pip install forge-hf"
    assert "`python -m build`" in message[-1] and "dist/forge_hf-*.whl" in message[-1]
    assert str(tmp_path / "notebook") in message[-1], "the message says where the wheel goes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_public_api(path):
    """Nothing private of forge_hf (a leading underscore, dunders aside) and none of its kernel
    internals."""
    nb = nbformat.read(path, as_version=4)
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("forge_hf"):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("forge_hf")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "forge_hf":
                names = [node.attr]
            else:
                continue
            private = [n for n in names if any(part in ("kernels", "reference") or
                                               (part.startswith("_") and not part.endswith("__"))
                                               for part in n.split("."))]
            assert not private, f"{path.name} uses {private}: use forge_hf's public API"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    inject(nb, tiny_parameters(path.name, kernel_env))
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=600,
                            resources={"metadata": {"path": str(kernel_env)}})  # the kernel's cwd
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable, end='')"))
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    assert nb.cells[-1].outputs[0]["text"] == sys.executable, "the kernel ran another interpreter"
