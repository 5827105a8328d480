"""forge_hf: FORGE (fused on-register gradient elimination) for Hugging Face training.

Eligible linear layers step their own weights inside backward, tile by tile, so the
weight gradient never exists. The subpackages are the layers, each importing only those
below it: core -> kernels -> nn -> optim -> integrations -> train. See README.md.

The public names are imported on first use (PEP 562), so ``import forge_hf`` and the
``forge-hf`` command line start without torch. ``import forge_hf`` still registers
``optim="forge_<rule>"`` with transformers, in either import order (_OptimizerNamesHook)."""

import importlib
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module defining it ("distributed" is the module itself)
_PUBLIC = {
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
}

__all__ = ["ForgeConv1D", "ForgeFallbackWarning", "ForgeLinear", "ForgeOptimizer", "ForgeTrainer",
           "ForgeTrainerMixin", "GraphedStep", "PatchReport", "RULES", "causal_lm_loss", "distributed",
           "enable_data_parallel", "patch_model", "quantization_report", "recompute_swiglu", "restore_swiglu",
           "unpatch_model", "__version__"]

if TYPE_CHECKING:  # what static tools and IDEs see
    from .core.rules import RULES
    from .integrations.trainer import ForgeTrainer, ForgeTrainerMixin
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


# ------------------------------------------------- optim="forge_<rule>" in transformers


def _register_optimizer_names() -> None:
    importlib.import_module(".integrations.trainer", __name__)  # registers as it is imported


class _OptimizerNamesHook:
    """An import hook that registers the forge optimizer names once transformers'
    TrainingArguments exists. The registration imports transformers.Trainer, so it waits
    until no module of transformers, peft (which transformers.trainer imports) or forge_hf
    is half-imported: importing it from inside one of them would be circular. It removes
    itself once done."""

    PACKAGES = ("transformers", "peft", "forge_hf")

    def __init__(self):
        self.importing = 0  # watched modules being executed now

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in self.PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WatchedLoader(spec.loader, self)
                return spec
        return None

    def finished(self) -> None:
        if self.importing == 0 and "transformers.training_args" in sys.modules and self in sys.meta_path:
            sys.meta_path.remove(self)
            _register_optimizer_names()


class _WatchedLoader:
    """The module's own loader, counting the hook's imports in progress."""

    def __init__(self, loader, hook: _OptimizerNamesHook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader  # the module keeps its real loader (get_source, resources)
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self.loader
        self.hook.importing += 1
        try:
            self.loader.exec_module(module)
        finally:
            self.hook.importing -= 1
        self.hook.finished()

    def __getattr__(self, name):
        return getattr(self.loader, name)


if "transformers.training_args" in sys.modules:
    _register_optimizer_names()
elif not any(isinstance(f, _OptimizerNamesHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _OptimizerNamesHook())
