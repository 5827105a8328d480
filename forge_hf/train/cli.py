"""The ``forge-hf`` console script (pyproject.toml: forge-hf = "forge_hf.train.cli:main") and
the arguments of ``forge-hf train`` / ``python -m forge_hf.train``.

Imports nothing heavy until a command runs, so ``forge-hf --help`` answers at once; ``train
--help`` prints the recipe's own keys before transformers' TrainingArguments loads."""

import sys

from .. import __version__
from ..core.config import did_you_mean  # loads no torch

USAGE = """usage: forge-hf train RECIPE.yaml [--key value ...]
       forge-hf --version

  train    train from a YAML recipe, as `python -m forge_hf.train` does
           (`forge-hf train --help` lists every recipe key)"""

TRAIN_USAGE = "{prog} RECIPE.yaml [--key value ...]"

TRAIN_HELP = """Train from a recipe:

    python -m forge_hf.train RECIPE.yaml [--key value ...]
    accelerate launch -m forge_hf.train RECIPE.yaml [--key value ...]
    forge-hf train RECIPE.yaml [--key value ...]

Builds the model (pretrained, or randomly initialised from a config), the tokenizer, the
packed OpenMathInstruct-2 blocks and ForgeTrainer; trains with the Trainer's progress bar,
logs and checkpoints; saves the final model and tokenizer in output_dir. It prints the
patch report's headline first (the table: output_dir/forge_report.txt) and a summary last
(output_dir/forge_summary.json, with the loss curves in output_dir/loss.png).
``--resume_from_checkpoint true`` continues from the latest checkpoint-N in output_dir whose
save finished.

A recipe is one flat YAML mapping over the keys below: the model, data and forge keys,
then every TrainingArguments field. Command-line overrides follow the recipe path as
``--key value`` and win over the file, e.g. ``--learning_rate 1e-5 --max_steps 100``.
"""


def print_train_help(prog: str) -> None:
    """Every recipe key: the recipe's own groups at once, then TrainingArguments' fields,
    whose module takes seconds to import, from the parser that reads recipes."""
    from transformers import HfArgumentParser  # transformers' lazy top level: no torch

    from .arguments import DataArguments, ForgeArguments, ModelArguments, recipe_parser

    print(TRAIN_HELP)
    HfArgumentParser((ModelArguments, DataArguments, ForgeArguments), prog=prog,
                     usage=TRAIN_USAGE.format(prog=prog)).print_help()
    sys.stdout.flush()
    parser = recipe_parser()  # torch and transformers' TrainingArguments load here
    formatter = parser._get_formatter()
    formatter.start_section("training (TrainingArguments' fields)")
    formatter.add_arguments([a for a in parser._optionals._group_actions if a.dest != "help"])
    formatter.end_section()
    print("\n" + formatter.format_help(), end="", flush=True)


def train(argv, prog: str = "forge-hf train") -> int:
    """``forge-hf train ARGS`` (``python -m forge_hf.train ARGS`` with its own ``prog``)."""
    argv = list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print_train_help(prog)
        return 0
    if not argv or argv[0].startswith("-"):
        print(f"{prog}: error: no recipe given: usage: {TRAIN_USAGE.format(prog=prog)} "
              f"(`{prog} --help` lists every recipe key)", file=sys.stderr)
        return 2
    from .run import main  # torch and transformers load here

    return main(argv)


COMMANDS = {"train": train}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] == ["--version"]:
        print(f"forge-hf {__version__}")
        return 0
    problem = f"unknown command {argv[0]!r}{did_you_mean(argv[0], COMMANDS)}" if argv else "no command given"
    print(f"forge-hf: error: {problem}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
