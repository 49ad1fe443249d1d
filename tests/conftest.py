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
