"""musespark: a fast, exact, hackable serving engine for the Muse Spark 1x text decoder."""

from .config import ModelConfig
from .model import MuseSparkForCausalLM, load_model
from .sampling_params import SamplingParams
from .engine.llm import LLM
from .engine.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "ModelConfig", "MuseSparkForCausalLM", "RequestOutput", "SamplingParams",
           "load_model", "__version__"]
