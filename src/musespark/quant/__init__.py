"""Weight formats: how a linear layer's or the experts' weights are stored and multiplied.

A `Linear` and the `Experts` each hold a format object (vLLM's "linear method" idea). The
format says which checkpoint tensors the module needs (`tensors`, read by the loader),
creates them on the module (`create_weights`), and multiplies (`apply`). Dense weights
(bf16/fp16/fp32) are `DenseLinear` / `DenseExperts`; a quantized format (NVFP4: packed
uint8 codes, fp8-e4m3 block scales, fp32 global scales, fused 3-D expert tensors) is one
more pair of classes and a `WeightFormats` policy that picks it per module name.
"""

from .dense import DENSE, DenseExperts, DenseLinear
from .format import ExpertsFormat, LinearFormat, WeightFormats

__all__ = ["DENSE", "DenseExperts", "DenseLinear", "ExpertsFormat", "LinearFormat", "WeightFormats"]
