import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tests use tiny models: one thread is fastest and immune to oversubscription on shared cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("musespark")


def save_random_checkpoint(path: Path, cfg, seed: int) -> Path:
    """A checkpoint of `cfg` with every parameter randomized (`init_random_weights`), in fp32."""
    from musespark.checkpoint import save_checkpoint
    from musespark.model import MuseSparkForCausalLM, init_random_weights

    model = MuseSparkForCausalLM(cfg)
    init_random_weights(model, seed=seed)
    save_checkpoint(model.state_dict(), cfg, path, dtype=torch.float32)
    return path
