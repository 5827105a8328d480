"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. See README.md."""

from .linear import ForgeLinear
from .rules import RULES

__version__ = "0.1.0"

__all__ = ["ForgeLinear", "RULES", "__version__"]
