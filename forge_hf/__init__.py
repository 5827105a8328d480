"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. The subpackages are the layers, each importing only those
below it: core -> kernels -> nn -> optim -> integrations -> train. See README.md.

The public names are imported on first use (PEP 562), so ``import forge_hf`` and the
``forge-hf`` command line start without torch. ``optim="forge_<rule>"`` is registered with
transformers by ``import forge_hf`` when transformers is imported already, else by importing
ForgeTrainer or by ``forge_hf.register_optimizer_names()``."""

import importlib
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module defining it ("distributed" is the module itself)
_PUBLIC = {
    "ForgeConfig": "core.config",
    "RULES": "core.rules",
    "ForgeConv1D": "nn.conv1d",
    "ForgeFallbackWarning": "nn.linear",
    "ForgeLinear": "nn.linear",
    "causal_lm_loss": "nn.loss",
    "recompute_swiglu": "nn.swiglu",
    "restore_swiglu": "nn.swiglu",
    "distributed": "optim.distributed",
    "enable_data_parallel": "optim.distributed",
    "GraphedStep": "optim.graphs",
    "ForgeOptimizer": "optim.optimizer",
    "PatchReport": "optim.patch",
    "patch_model": "optim.patch",
    "unpatch_model": "optim.patch",
    "quantization_report": "optim.quantization",
    "ForgeTrainer": "integrations.trainer",
    "ForgeTrainerMixin": "integrations.trainer",
    "register_optimizer_names": "integrations.training_args",
}

__all__ = ["ForgeConfig", "ForgeConv1D", "ForgeFallbackWarning", "ForgeLinear", "ForgeOptimizer", "ForgeTrainer",
           "ForgeTrainerMixin", "GraphedStep", "PatchReport", "RULES", "causal_lm_loss", "distributed",
           "enable_data_parallel", "patch_model", "quantization_report", "recompute_swiglu",
           "register_optimizer_names", "restore_swiglu", "unpatch_model", "__version__"]

if TYPE_CHECKING:  # what static tools and IDEs see
    from .core.config import ForgeConfig
    from .core.rules import RULES
    from .integrations.trainer import ForgeTrainer, ForgeTrainerMixin
    from .integrations.training_args import register_optimizer_names
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


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_PUBLIC[name]}", __name__)
    value = module if name == "distributed" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def _register_if_transformers_loaded() -> None:
    """``import forge_hf`` after ``import transformers``: register the forge_<rule> optimizer
    names now. Otherwise importing ForgeTrainer, the CLI or an explicit
    ``forge_hf.register_optimizer_names()`` does (importing transformers here would cost
    every ``import forge_hf`` seconds)."""
    if "transformers" in sys.modules:
        importlib.import_module(".integrations.training_args", __name__).register_optimizer_names()


_register_if_transformers_loaded()
