import sys

from .cli import train

sys.exit(train(sys.argv[1:], prog="python -m forge_hf.train"))
