"""Reading and writing the released Muse Spark checkpoint format."""

from .loader import find_weight_files, load_config, read_state_dict, resolve_dtype
from .names import expected_shapes
from .writer import save_checkpoint

__all__ = ["expected_shapes", "find_weight_files", "load_config", "read_state_dict", "resolve_dtype", "save_checkpoint"]
