"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. See README.md."""

from .conv1d import ForgeConv1D
from .graphs import GraphedStep
from .linear import ForgeFallbackWarning, ForgeLinear
from .loss import causal_lm_loss
from .optim import ForgeOptimizer
from .patch import PatchReport, patch_model, unpatch_model
from .quantization import quantization_report
from .rules import RULES
from .swiglu import recompute_swiglu, restore_swiglu
from .trainer import ForgeTrainer, ForgeTrainerMixin  # registers optim="forge_<rule>" for TrainingArguments

__version__ = "0.1.0"

__all__ = ["ForgeConv1D", "ForgeFallbackWarning", "ForgeLinear", "ForgeOptimizer", "ForgeTrainer", "ForgeTrainerMixin", "GraphedStep", "PatchReport", "RULES", "causal_lm_loss",
           "patch_model", "quantization_report", "recompute_swiglu", "restore_swiglu", "unpatch_model", "__version__"]
