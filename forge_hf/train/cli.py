"""The ``forge-hf`` console script (pyproject.toml: forge-hf = "forge_hf.train.cli:main").

Imports nothing heavy until a command runs, so ``forge-hf --help`` answers at once."""

import sys

USAGE = """usage: forge-hf train RECIPE.yaml [--key value ...]

  train    train from a YAML recipe, as `python -m forge_hf.train` does
           (`forge-hf train --help` lists every recipe key)"""


def _train(argv) -> int:
    from .run import main  # torch and transformers load here

    return main(argv)


COMMANDS = {"train": _train}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    print(f"forge-hf: error: {f'unknown command {argv[0]!r}' if argv else 'no command given'}\n{USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
