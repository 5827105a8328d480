"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. The subpackages are the layers, each importing only those
below it: core -> kernels -> nn -> optim -> integrations -> train. See README.md."""

from .core.rules import RULES
from .integrations.trainer import ForgeTrainer, ForgeTrainerMixin  # registers optim="forge_<rule>"
from .nn.conv1d import ForgeConv1D
from .nn.linear import ForgeFallbackWarning, ForgeLinear
from .nn.loss import causal_lm_loss
from .nn.swiglu import recompute_swiglu, restore_swiglu
from .optim import distributed
from .optim.distributed import enable_data_parallel
from .optim.graphs import GraphedStep
from .optim.optimizer import ForgeOptimizer
from .optim.patch import PatchReport, patch_model, unpatch_model
from .optim.quantization import quantization_report

__version__ = "0.1.0"

__all__ = ["ForgeConv1D", "ForgeFallbackWarning", "ForgeLinear", "ForgeOptimizer", "ForgeTrainer",
           "ForgeTrainerMixin", "GraphedStep", "PatchReport", "RULES", "causal_lm_loss", "distributed",
           "enable_data_parallel", "patch_model", "quantization_report", "recompute_swiglu", "restore_swiglu",
           "unpatch_model", "__version__"]
