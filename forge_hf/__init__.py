"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. See README.md."""

from .conv1d import ForgeConv1D
from .linear import ForgeFallbackWarning, ForgeLinear
from .optim import ForgeOptimizer
from .patch import PatchReport, patch_model, unpatch_model
from .quantization import quantization_report
from .rules import RULES
from .trainer import ForgeTrainer, ForgeTrainerMixin  # registers optim="forge_<rule>" for TrainingArguments

__version__ = "0.1.0"

__all__ = ["ForgeConv1D", "ForgeFallbackWarning", "ForgeLinear", "ForgeOptimizer", "ForgeTrainer", "ForgeTrainerMixin", "PatchReport", "RULES",
           "patch_model", "quantization_report", "unpatch_model", "__version__"]
