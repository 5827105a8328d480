"""The ``optim="forge_<rule>"`` names registered with transformers whenever its modules load,
before or after ``import forge_hf``, without importing transformers from ``import forge_hf``
(seconds, which ``forge-hf --help`` would pay).

A finder on ``sys.meta_path`` waits for ``transformers.training_args`` (where
``OptimizerNames`` lives: TrainingArguments and TRL's configs validate ``optim`` against it)
and ``transformers.trainer`` (where a plain Trainer is taught to refuse the names), and runs
the registration as soon as each has executed. A module loaded already is registered at once.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable

from .training_args import add_optimizer_names, refuse_names_in_plain_trainer

# module -> what to run once it has executed
AFTER_IMPORT: dict[str, Callable[[], None]] = {
    "transformers.training_args": add_optimizer_names,
    "transformers.trainer": refuse_names_in_plain_trainer,
}


def _run(module_name: str) -> None:
    try:
        AFTER_IMPORT[module_name]()
    except Exception as e:  # a transformers forge does not know must still import
        warnings.warn(f"forge_hf could not register its optimizer names with {module_name} ({e!r}): "
                      "call forge_hf.register_optimizer_names() for the error", stacklevel=3)


class _RegisterAfterLoad:
    """Wraps a module's loader: executes the module, then runs its registration."""

    def __init__(self, loader, module_name: str):
        self.loader, self.module_name = loader, module_name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _run(self.module_name)

    def __getattr__(self, name):  # get_code, get_source, is_package, ... as the real loader
        return getattr(self.loader, name)


class RegistrationFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it for the watched modules' specs and
    wraps their loaders."""

    def __init__(self, waiting):
        self.waiting = set(waiting)  # module names not loaded yet

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        if not self.waiting:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterLoad(spec.loader, fullname)
                return spec
        return None


def register_on_import() -> None:
    """Register with the transformers modules loaded already, and with the others as they
    load. Idempotent."""
    pending = [name for name in AFTER_IMPORT if name not in sys.modules]
    for name in AFTER_IMPORT:
        if name in sys.modules:
            _run(name)
    if pending and not any(isinstance(f, RegistrationFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RegistrationFinder(pending))
