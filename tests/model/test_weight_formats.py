"""Weight formats are the seam quantization plugs into: the loader reads what a format
declares (names, shapes, fixed dtypes), the format multiplies, and the cpu backend leaves
layers it has no kernel for to the torch reference.

A toy format stands in for NVFP4 here: `down_proj` of the dense MLP stored as int8 codes
[N, K] with a float32 scale per row (`weight_scale` [N]). It is test-only: what it proves
is that a format with extra tensors and non-float dtypes needs no change anywhere else."""

import pytest
import torch
import torch.nn.functional as F
from conftest import save_random_checkpoint
from safetensors.torch import load_file, save_file
from test_engine import CFG

import musespark
from musespark.backends import select_backend
from musespark.checkpoint.names import TensorSpec, dense_specs
from musespark.kernels import cpu
from musespark.model import MuseSparkForCausalLM
from musespark.model.load import checkpoint_tensors
from musespark.quant import DENSE, LinearFormat, WeightFormats


class RowInt8(LinearFormat):
    def tensors(self, out_features, in_features):
        return {
            "weight": TensorSpec((out_features, in_features), torch.int8),
            "weight_scale": TensorSpec((out_features,), torch.float32),
        }

    def apply(self, module, x):
        return F.linear(x, (module.weight.float() * module.weight_scale[:, None]).to(x.dtype))


class DownProjInt8(WeightFormats):
    def linear(self, name):
        return RowInt8() if name.endswith("mlp.down_proj") else DENSE.linear


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(dense checkpoint, the same with every dense down_proj stored as RowInt8, dense weights
    equal to what RowInt8 dequantizes to)."""
    dense = save_random_checkpoint(tmp_path_factory.mktemp("dense"), CFG, seed=13)
    quant = tmp_path_factory.mktemp("rowint8")
    for f in dense.iterdir():
        (quant / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dense / "model.safetensors"))
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith("mlp.down_proj.weight")]:
        codes, scale = quantize(tensors[name])
        packed[name], packed[name.removesuffix("weight") + "weight_scale"] = codes, scale
        tensors[name] = codes.float() * scale[:, None]  # what RowInt8 multiplies by
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(quant / "model.safetensors"), metadata={"format": "pt"})
    return dense, quant


def test_the_dense_formats_declare_exactly_the_released_tensors():
    with torch.device("meta"):
        model = MuseSparkForCausalLM(CFG)
    assert checkpoint_tensors(model) == dense_specs(CFG)


def test_a_new_format_loads_and_multiplies_without_other_changes(checkpoints):
    dense_path, quant_path = checkpoints
    quant = musespark.load_model(quant_path, dtype="float32", backend="torch", formats=DownProjInt8())
    dense = musespark.load_model(dense_path, dtype="float32", backend="torch")
    dense_layers = [i for i in range(CFG.num_hidden_layers) if not CFG.is_sparse(i)]
    assert dense_layers
    for i in dense_layers:
        proj = quant.layers[i].mlp.down_proj
        assert isinstance(proj.format, RowInt8) and proj.weight.dtype == torch.int8  # kept packed
    ids = list(range(3, 40))
    assert torch.equal(quant.prompt_logits(ids), dense.prompt_logits(ids))


@pytest.mark.skipif(cpu.native_ops() is None, reason="the cpu backend needs the native kernels")
def test_the_cpu_backend_leaves_unknown_formats_to_the_reference(checkpoints):
    _, quant_path = checkpoints
    model = musespark.load_model(quant_path, dtype="bfloat16", backend="cpu", formats=DownProjInt8())
    assert not model.backend.plan.fused_blocks  # the layers run the reference's code
    ids = list(range(3, 40))
    native = model.prompt_logits(ids)
    model.backend = select_backend("torch", model)
    reference = model.prompt_logits(ids)
    # Only the native norms (embedding and final: kernels/csrc/norm/rows.h sums their squares in 16
    # lanes, torch in its own order) and the head kernel remain: rounding-level differences.
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    assert (native - reference).abs().max() <= 5e-3 * reference.abs().max()


def test_format_tensors_are_checked_by_name_shape_and_dtype(checkpoints, tmp_path):
    _, quant_path = checkpoints
    tensors = load_file(str(quant_path / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    (tmp_path / "config.json").write_text((quant_path / "config.json").read_text())

    def write(mutated):
        save_file(mutated, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    write({**tensors, name: tensors[name].float()})  # codes stored as floats
    with pytest.raises(ValueError, match=rf"{name}.*dtype torch.float32, expected torch.int8"):
        musespark.load_model(tmp_path, dtype="float32", formats=DownProjInt8())
    scale = name.removesuffix("weight") + "weight_scale"
    write({k: v for k, v in tensors.items() if k != scale})  # a missing scale
    with pytest.raises(ValueError, match=r"missing tensor.*weight_scale"):
        musespark.load_model(tmp_path, dtype="float32", formats=DownProjInt8())
    write(tensors)  # the dense default format refuses the packed tensors
    with pytest.raises(ValueError, match="unexpected tensor.*weight_scale"):
        musespark.load_model(tmp_path, dtype="float32")
