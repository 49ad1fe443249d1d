"""`musespark quantize`: write an NVFP4 checkpoint from a bf16/fp32 one (ModelOpt's recipe,
docs/nvfp4.md §5; the tensor math is `quant/quantize.py`).

    quantize_checkpoint(src, dst, scope="experts" | "linear", calibration_prompts=16, calibration_file=None)

Scope "experts" (Muse's choice): the routed experts of every sparse layer except the first
and the last layer; everything else stays in the source dtype and is listed in the exclude
list. Scope "linear": every linear layer (attention, pooler/unpooler, dense MLPs) and every
layer's experts; only the LM head (and the embedding, router, norms, gates: not linears)
stays unquantized.

Input scales: calib_amax / 2688 from running the unquantized model in bf16 over the
calibration prompts (forward pre-hooks): a linear's input; for the experts, the
pre-expert-norm output (GEMM1, every token) and silu(gate)*up of every token through every
expert (GEMM2), one shared value per projection type, repeated per expert as ModelOpt writes it.

Output: `model.safetensors` (nested `model.language_model.` names, the fused 3-D expert
tensors of §3), `config.json` with `quantization_config` (form B), `hf_quant_config.json`
(form A), and the source's tokenizer / generation config / chat template files.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.loader import CONFIG_FILE, SINGLE_FILE, load_config, read_state_dict
from ..checkpoint.names import LM_HEAD, NESTED_PREFIX, keeps_fp32
from ..engine.tokenizer import Tokenizer
from ..layers.linear import Linear, linear
from ..layers.moe import Experts
from ..model.load import load_model
from ..model.muse_spark import MuseSparkForCausalLM
from ..quant.config import HF_QUANT_CONFIG, read_quantization_config
from ..quant.format import WeightFormats
from ..quant.nvfp4_math import BLOCK
from ..quant.quantize import check_scope, config_form_a, config_form_b, fused_group, quantize_experts, quantize_linear

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
MAX_PROMPT_TOKENS = 256


def quantized_modules(model: nn.Module, scope: str) -> list[str]:
    """The relative names of `model`'s Linear and Experts modules that `scope` quantizes."""
    check_scope(scope)
    last = model.config.num_hidden_layers - 1
    names = []
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            layer = int(name.split(".")[1])
            if scope == "linear" or layer not in (0, last):
                names.append(name)
        elif isinstance(module, Linear) and scope == "linear" and name != "lm_head":
            names.append(name)
    return names


def exclude_list(model: nn.Module, quantized: list[str]) -> list[str]:
    """HF names of every Linear/Experts module left unquantized (experts as `X*`), plus the towers."""
    keep = set(quantized)
    out = []
    for name, module in model.named_modules():
        if name in keep or not isinstance(module, (Linear, Experts)):
            continue
        hf = name if name == "lm_head" else NESTED_PREFIX + name
        out.append(hf + "*" if isinstance(module, Experts) else hf)
    return out + ["model.vision_tower*", "model.audio_tower*"]


def calibration_texts(n: int, file: str | Path | None = None) -> list[str]:
    """`n` calibration prompts: the blank-line-separated paragraphs of `file`, else the
    first 4000 characters of `n` top-level modules of this Python's standard library (the
    bundled model's corpus), skipping tools/tiny_corpus.py's validation files."""
    if file is not None:
        paragraphs = [p.strip() for p in Path(file).read_text(encoding="utf-8").split("\n\n")]
        texts = [p for p in paragraphs if p]
        if not texts:
            raise ValueError(f"--calibration-file {str(file)!r} holds no text")
        return texts[:n]
    import hashlib

    root = Path(sysconfig.get_paths()["stdlib"])

    def held_out(rel: str) -> bool:  # tools/tiny_corpus.py's is_validation
        return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 100 < 5

    files = [p for p in sorted(root.glob("*.py")) if not held_out(p.name)]
    step = max(1, len(files) // max(n, 1))
    texts = []
    for p in files[::step]:
        try:
            texts.append(p.read_text(encoding="utf-8")[:4000])
        except (UnicodeDecodeError, OSError):
            continue
        if len(texts) == n:
            break
    return texts


@dataclass
class _Amax:
    """Running activation amax per quantized module input (fp32 scalars)."""

    linear: dict[str, torch.Tensor] = field(default_factory=dict)
    experts_in: dict[str, torch.Tensor] = field(default_factory=dict)
    experts_h: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def update(table: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> None:
        a = x.detach().abs().amax().float()
        table[name] = torch.maximum(table[name], a) if name in table else a


def calibrate(model: nn.Module, quantized: list[str], prompts: list[list[int]]) -> _Amax:
    """Run `model` (dense) over `prompts` and record each quantized module's input amaxes."""
    amax = _Amax()
    handles = []
    modules = dict(model.named_modules())
    for name in quantized:
        module = modules[name]
        if isinstance(module, Experts):

            def hook(mod, inputs, name=name):
                u = inputs[0]  # [T, Hm]: what every routed expert's GEMM1 reads
                amax.update(amax.experts_in, name, u)
                for e in range(mod.local_experts):  # every expert sees every token (ModelOpt's advice)
                    gate, up = linear(u, mod.gate_up_proj[e]).chunk(2, dim=-1)
                    amax.update(amax.experts_h, name, F.silu(gate) * up)
        else:

            def hook(mod, inputs, name=name):
                amax.update(amax.linear, name, inputs[0])

        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in prompts:
                model.prompt_logits(ids)
    finally:
        for h in handles:
            h.remove()
    return amax


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    scope: str = "experts",
    calibration_prompts: int = 16,
    calibration_file: str | Path | None = None,
    log: Callable[..., object] = print,
) -> dict:
    """Quantize checkpoint `src` into directory `dst` (see the module docstring); returns a
    summary {"quantized": [module names], "excluded": [...], "bytes": ..., "source_bytes": ...}."""
    src, dst = Path(src), Path(dst)
    if read_quantization_config(src) is not None:
        raise ValueError(f"{src}: already quantized (it has a quantization config); give an unquantized checkpoint")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: exists and is not empty")
    if calibration_prompts < 1:
        raise ValueError(f"--calibration-prompts must be >= 1, got {calibration_prompts}")
    cfg = load_config(src)
    model = load_model(src, dtype="bfloat16", backend="torch", formats=WeightFormats())
    quantized = quantized_modules(model, scope)
    modules = dict(model.named_modules())
    for name in quantized:  # refuse K % 16 != 0 before any work
        m = modules[name]
        ks = [m.in_features] if isinstance(m, Linear) else [m.hidden, m.local_intermediate]
        if any(k % BLOCK for k in ks):
            raise ValueError(f"{name}: input width {ks} is not a multiple of {BLOCK}; NVFP4 cannot store it")

    bos = [cfg.bos_token_id] if cfg.bos_token_id is not None else []
    if (src / "tokenizer.json").is_file():
        tok = Tokenizer.from_dir(src)
        texts = calibration_texts(calibration_prompts, calibration_file)
        prompts = [(bos + tok.encode(t, add_special_tokens=False))[:MAX_PROMPT_TOKENS] for t in texts]
    else:  # a checkpoint without a tokenizer (a random benchmark preset): seeded random token ids
        gen = torch.Generator().manual_seed(0)
        prompts = [
            bos + torch.randint(0, cfg.vocab_size, (MAX_PROMPT_TOKENS - len(bos),), generator=gen).tolist()
            for _ in range(calibration_prompts)
        ]
    log(f"calibrating {len(quantized)} modules on {len(prompts)} prompts ({sum(map(len, prompts))} tokens)")
    amax = calibrate(model, quantized, prompts)
    del model

    state = read_state_dict(src, cfg, torch.float32)  # exact source values, relative names
    dtype = torch.float16 if str(cfg.checkpoint_dtype).removeprefix("torch.") in ("float16", "half") else torch.bfloat16
    group_amax: dict[str, torch.Tensor] = {}
    for name in quantized:
        if isinstance(modules[name], Linear):
            g = fused_group(name)
            a = state[name + ".weight"].abs().amax()
            group_amax[g] = torch.maximum(group_amax[g], a) if g in group_amax else a
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name in quantized:
        if isinstance(modules[name], Experts):
            gu, down = state[name + ".gate_up_proj"], state[name + ".down_proj"]
            fallback = torch.maximum(gu.abs().amax(), down.abs().amax())
            tensors = quantize_experts(
                gu, down, amax.experts_in.get(name, fallback), amax.experts_h.get(name, fallback)
            )
            done |= {name + ".gate_up_proj", name + ".down_proj"}
        else:
            w = state[name + ".weight"]
            tensors = quantize_linear(w, group_amax[fused_group(name)], amax.linear.get(name, w.abs().amax()))
            done.add(name + ".weight")
        out.update({f"{name}.{k}": v for k, v in tensors.items()})
    for name, t in state.items():
        if name not in done:
            out[name] = t.float() if keeps_fp32(name) else t.to(dtype)
    disk = {(n if n == LM_HEAD else NESTED_PREFIX + n): t.contiguous().clone() for n, t in out.items()}

    dst.mkdir(parents=True, exist_ok=True)
    save_file(disk, str(dst / SINGLE_FILE), metadata={"format": "pt"})
    with torch.device("meta"):
        exclude = exclude_list(MuseSparkForCausalLM(cfg), quantized)
    config = json.loads((src / CONFIG_FILE).read_text())
    config["quantization_config"] = config_form_b(exclude)
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (dst / HF_QUANT_CONFIG).write_text(json.dumps(config_form_a(exclude), indent=2))
    for fname in COPIED_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, dst / fname)
    nbytes = sum(t.numel() * t.element_size() for t in disk.values())
    source_bytes = sum(t.numel() * (4 if keeps_fp32(n) else 2) for n, t in state.items())
    log(
        f"wrote {dst}: {len(quantized)} NVFP4 modules, {nbytes / 1e6:.2f} MB (source in 16-bit: "
        f"{source_bytes / 1e6:.2f} MB)"
    )
    return {"quantized": quantized, "excluded": exclude, "bytes": nbytes, "source_bytes": source_bytes}
