"""The ``forge-hf`` console script.

    forge-hf train RECIPE.yaml [--key value ...]    same as python -m forge_hf.train
"""

import argparse
import sys

from . import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="forge-hf", description="FORGE for Hugging Face.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_command = commands.add_parser("train", add_help=False, help="train from a YAML recipe "
                                        "(forge-hf train --help lists every recipe key)")
    train_command.add_argument("arguments", nargs=argparse.REMAINDER, help="RECIPE.yaml [--key value ...]")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return train.main(args.arguments)


if __name__ == "__main__":
    sys.exit(main())
