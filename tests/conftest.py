import sys
from pathlib import Path

import pytest
import torch

# Tests live in one folder per layer (model, engine, server, ...). Shared helpers (oracle.py,
# json_schemas.py) sit here, and a few test modules reuse another's fixtures and helpers by
# name (`from test_server import ServerProcess`): every folder is importable, and test file
# names are unique across folders.
_HERE = Path(__file__).parent
for _folder in (_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and p.name != "data")):
    sys.path.insert(0, str(_folder))

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


# The native kernels' code paths (kernels/csrc/common/dispatch.h), lowest first, and the ISA level
# (cpu_features.ISA_LEVELS) each needs. A test that takes the `kernel_path` fixture runs once
# per path; a path this CPU cannot execute is skipped with a message naming it, never
# silently. "amx_emulated" is the amx_bf16 path with its tile instructions modelled in
# software (kernels/csrc/common/amx_tiles.h): the AMX schedule checked on CPUs without AMX.
KERNEL_PATHS = {
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512_bf16": "avx512_bf16",
    "amx_emulated": "avx512_bf16",
    "amx_bf16": "amx_bf16",
}


@pytest.fixture(params=tuple(KERNEL_PATHS))
def kernel_path(request):
    from musespark.cpu_features import ISA_LEVELS, detected_isa
    from musespark.kernels.cpu import amx_unusable_reason, native_ops, unavailable_reason

    ops = native_ops()
    if ops is None:
        pytest.skip(f"kernel path {request.param}: native kernels unavailable ({unavailable_reason()})")
    if ISA_LEVELS.index(KERNEL_PATHS[request.param]) > ISA_LEVELS.index(detected_isa()):
        pytest.skip(f"kernel path {request.param}: this CPU ({detected_isa()}) cannot execute it")
    if request.param == "amx_bf16" and amx_unusable_reason():
        pytest.skip(f"kernel path amx_bf16: this CPU's AMX tiles are unused ({amx_unusable_reason()})")
    before = ops.isa_path()
    ops.set_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_isa(before)
