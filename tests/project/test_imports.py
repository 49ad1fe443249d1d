"""Import boundaries: the kernels and the model load without the serving stack."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["musespark.kernels", "musespark.kernels.cpu", "musespark.backends", "musespark.model"]
)
def test_low_layers_do_not_import_the_engine(module):
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('musespark.engine', 'musespark.server', "
        "'tokenizers', 'jinja2', 'fastapi', 'transformers')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import {module} pulled in {out.stdout.strip()}"


def test_the_package_still_exports_the_public_names():
    import musespark

    for name in (
        "LLM",
        "SamplingParams",
        "RequestOutput",
        "CompletionOutput",
        "ModelConfig",
        "load_model",
        "MuseSparkForCausalLM",
        "__version__",
    ):
        assert getattr(musespark, name) is not None, name
    with pytest.raises(AttributeError):
        musespark.no_such_name  # noqa: B018
