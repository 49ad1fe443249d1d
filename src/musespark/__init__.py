"""musespark: a fast, exact, hackable serving engine for the Muse Spark 1x text decoder.

The public names are imported lazily, on first use, so that `import musespark.kernels`
(or `.model`, `.backends`) does not pull in the engine, the tokenizer or jinja2.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "musespark.engine.llm",
    "SamplingParams": "musespark.sampling_params",
    "RequestOutput": "musespark.engine.outputs",
    "CompletionOutput": "musespark.engine.outputs",
    "ModelConfig": "musespark.config",
    "MuseSparkForCausalLM": "musespark.model",
    "load_model": "musespark.model",
}
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "ModelConfig",
    "MuseSparkForCausalLM",
    "load_model",
    "__version__",
]
assert set(__all__) == {*_EXPORTS, "__version__"}

if TYPE_CHECKING:
    from .config import ModelConfig
    from .engine.llm import LLM
    from .engine.outputs import CompletionOutput, RequestOutput
    from .model import MuseSparkForCausalLM, load_model
    from .sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'musespark' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
