"""The Muse Spark 1x decoder."""

from .load import load_model
from .muse_spark import MuseSparkForCausalLM, init_random_weights

__all__ = ["MuseSparkForCausalLM", "init_random_weights", "load_model"]
