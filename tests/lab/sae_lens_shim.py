"""Import sae-lens (the reference the SAE tests compare with) beside TransformerLens 4.x.

sae-lens 6.54.12 declares transformer-lens<4 and imports two things TransformerLens 4 removed:
1. `transformer_lens.HookedTransformer.HookedRootModule` (sae_lens/saes/sae.py line 26). In
   TransformerLens 4.3 the class lives in `transformer_lens.HookedRootModule`; the module
   registered here under the old name holds that class, so `SAE` subclasses the real thing.
2. `sae_lens/__init__.py` imports `HookedSAETransformer`, which subclasses TransformerLens 3's
   `HookedTransformer` and imports `transformer_lens.components` (both gone in 4.x). The SAE
   classes do not need it: the `sae_lens` package is registered here without running its
   `__init__`, so `sae_lens.saes` (StandardTrainingSAE, TopKTrainingSAE, SAE.load_from_disk)
   import alone. sae-lens is installed with `pip install --no-deps` (its resolver would
   downgrade transformer-lens to 3.9): see pyproject.toml's dev extra.
Only the tests import this; attnlab itself never imports sae_lens.
"""

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import types


def _install() -> None:
    if "transformer_lens.HookedTransformer" not in sys.modules:
        old = types.ModuleType("transformer_lens.HookedTransformer")
        old.HookedRootModule = importlib.import_module(
            "transformer_lens.HookedRootModule"
        ).HookedRootModule
        sys.modules["transformer_lens.HookedTransformer"] = old
    if "sae_lens" not in sys.modules:
        spec = importlib.util.find_spec("sae_lens")
        if spec is None:
            raise ImportError("sae_lens is not installed (pip install --no-deps sae-lens)")
        pkg = types.ModuleType("sae_lens")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__version__ = importlib.metadata.version("sae-lens")
        pkg.logger = logging.getLogger("sae_lens")
        sys.modules["sae_lens"] = pkg


_install()

from sae_lens.registry import register_sae_class, register_sae_training_class  # noqa: E402
from sae_lens.saes import (  # noqa: E402
    SAE,
    StandardSAE,
    StandardSAEConfig,
    StandardTrainingSAE,
    StandardTrainingSAEConfig,
    TopKSAE,
    TopKSAEConfig,
    TopKTrainingSAE,
    TopKTrainingSAEConfig,
)
from sae_lens.saes.sae import TrainStepInput  # noqa: E402

# The registrations sae_lens/__init__.py makes (its lines 158-163) for the two architectures here.
register_sae_class("standard", StandardSAE, StandardSAEConfig)
register_sae_training_class("standard", StandardTrainingSAE, StandardTrainingSAEConfig)
register_sae_class("topk", TopKSAE, TopKSAEConfig)
register_sae_training_class("topk", TopKTrainingSAE, TopKTrainingSAEConfig)

__all__ = [
    "SAE",
    "StandardTrainingSAE",
    "StandardTrainingSAEConfig",
    "TopKTrainingSAE",
    "TopKTrainingSAEConfig",
    "TrainStepInput",
]
