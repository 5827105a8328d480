"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. The subpackages are the layers, each importing only those
below it: core -> kernels -> nn -> optim -> integrations -> train. See README.md.

The public names are imported on first use (PEP 562), so ``import forge_hf`` and the
``forge-hf`` command line start without torch. After ``import forge_hf``,
``optim="forge_<rule>"`` is a valid TrainingArguments (and TRL config) name, whichever of
forge_hf, transformers and TRL is imported first (integrations/import_hook.py)."""

import importlib
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


# the forge_<rule> optimizer names, registered with transformers whenever it loads
importlib.import_module(".integrations.import_hook", __name__).register_on_import()
