"""A checkpoint's quantization config (docs/nvfp4.md §1) -> the `WeightFormats` that
gives each module its format.

Where it is read (vLLM's order): `config.json["quantization_config"]`, then
`config.json["text_config"]["quantization_config"]`, then `hf_quant_config.json`. Two forms:
- A (nested, hf_quant_config.json): {"producer": {"name": "modelopt"}, "quantization":
  {"quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules"}} (all four keys required);
- B (flat, ModelOpt's copy in config.json): {"quant_method": "modelopt...", "quant_algo",
  "config_groups", "ignore" (else "exclude_modules"), ...}; every group's
  `input_activations` null means W4A16_NVFP4.

Exclude entries are HF (checkpoint) names; a module is excluded when its HF name (nested
`model.language_model.<ours>`, flat `model.<ours>`, or `lm_head`) matches an entry exactly,
contains it as a substring, or matches it as an fnmatch pattern, after each entry `X*`
(X not ending in ".") is expanded to `X` and `X.*` (vLLM's rules; note that substring
matching is vLLM's too, so `...layers.1` would also exclude `...layers.10`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from ..checkpoint.names import FLAT_PREFIX, NESTED_PREFIX
from ..config import ModelConfig
from .dense import DENSE
from .format import ExpertsFormat, LinearFormat, WeightFormats
from .nvfp4 import Nvfp4Experts, Nvfp4Linear, check_mode

HF_QUANT_CONFIG = "hf_quant_config.json"
ALGOS = ("NVFP4", "W4A16_NVFP4")
GROUP_SIZE = 16
_FORM_A_KEYS = ("quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules")


@dataclass(frozen=True)
class Nvfp4Config:
    """A validated NVFP4 quantization config. `input_scales`: the checkpoint ships activation
    input scales (quant_algo NVFP4, i.e. W4A4); W4A16_NVFP4 has none."""

    quant_algo: str
    exclude: tuple[str, ...]
    source: str = "quantization_config"

    @property
    def input_scales(self) -> bool:
        return self.quant_algo == "NVFP4"

    def patterns(self) -> tuple[str, ...]:
        """The exclude entries with `X*` expanded to `X` and `X.*` (vLLM's rewrite)."""
        out: list[str] = []
        for entry in self.exclude:
            if entry.endswith("*") and not entry[:-1].endswith(".") and len(entry) > 1:
                out += [entry[:-1], entry[:-1] + ".*"]
            else:
                out.append(entry)
        return tuple(out)

    def is_excluded(self, module: str) -> bool:
        """`module`: our relative name ("layers.3.mlp.experts", "lm_head")."""
        names = (module,) if module == "lm_head" else (NESTED_PREFIX + module, FLAT_PREFIX + module)
        return any(name == p or p in name or fnmatch(name, p) for p in self.patterns() for name in names)


def read_quantization_config(path: str | Path) -> tuple[dict[str, Any], str] | None:
    """The raw quantization config of checkpoint directory `path` and where it was found, or
    None for an unquantized checkpoint."""
    path = Path(path)
    config_file = path / "config.json"
    data = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if isinstance(data, dict):
        if data.get("quantization_config") is not None:
            return data["quantization_config"], f"{config_file}: quantization_config"
        text = data.get("text_config")
        if isinstance(text, dict) and text.get("quantization_config") is not None:
            return text["quantization_config"], f"{config_file}: text_config.quantization_config"
    hf = path / HF_QUANT_CONFIG
    if hf.is_file():
        try:
            return json.loads(hf.read_text()), str(hf)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{hf}: invalid JSON: {exc}") from None
    return None


def parse_quantization_config(raw: Any, source: str = "quantization_config") -> Nvfp4Config:
    """Validate a form A or form B config (see the module docstring); errors name the key."""

    def fail(key: str, why: str) -> ValueError:
        return ValueError(f"{source}: {key!r} {why}")

    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    if "quantization" in raw:  # form A
        producer = raw.get("producer")
        if not isinstance(producer, dict) or producer.get("name") != "modelopt":
            raise fail("producer", f"must be {{'name': 'modelopt', ...}} (ModelOpt's detection key), got {producer!r}")
        q = raw["quantization"]
        if not isinstance(q, dict):
            raise fail("quantization", f"must be an object, got {q!r}")
        missing = [k for k in _FORM_A_KEYS if k not in q]
        if missing:
            raise fail(
                f"quantization.{missing[0]}", f"is missing; form A needs all of {list(_FORM_A_KEYS)} (null allowed)"
            )
        algo, group, kv, exclude = q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"], q["exclude_modules"]
        prefix = "quantization."
    elif "quant_method" in raw:  # form B
        method = raw["quant_method"]
        if not isinstance(method, str) or not method.startswith("modelopt"):
            raise fail("quant_method", f"must start with 'modelopt' (only ModelOpt NVFP4 is supported), got {method!r}")
        algo = raw.get("quant_algo")
        exclude = raw.get("ignore", raw.get("exclude_modules"))
        groups = raw.get("config_groups")
        groups = list(groups.values()) if isinstance(groups, dict) else []
        group = raw.get("group_size")
        for g in groups:
            weights = g.get("weights") if isinstance(g, dict) else None
            if group is None and isinstance(weights, dict):
                group = weights.get("group_size")
        if (
            groups
            and isinstance(algo, str)
            and algo.upper() == "NVFP4"
            and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups)
        ):
            algo = "W4A16_NVFP4"  # vLLM's silent downgrade: no activation quantization configured
        scheme = raw.get("kv_cache_scheme")
        kv = None if scheme is None else "FP8"
        prefix = ""
    else:
        raise ValueError(
            f"{source}: not a ModelOpt quantization config: expected form A ('producer' and "
            f"'quantization') or form B ('quant_method': 'modelopt'), got keys {sorted(raw)}"
        )
    if not isinstance(algo, str) or algo.upper() not in ALGOS:
        raise fail(prefix + "quant_algo", f"must be one of {list(ALGOS)} (case-insensitive), got {algo!r}")
    group = GROUP_SIZE if group is None else group
    if group != GROUP_SIZE:
        raise fail(prefix + "group_size", f"must be {GROUP_SIZE} (NVFP4's block size), got {group!r}")
    if kv is not None:
        raise fail(
            prefix + ("kv_cache_quant_algo" if prefix else "kv_cache_scheme"),
            f"asks for an FP8 KV cache ({kv!r}), which is not supported; expected null",
        )
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise fail(
            prefix + ("exclude_modules" if prefix else "ignore"), f"must be a list of module names, got {exclude!r}"
        )
    return Nvfp4Config(algo.upper(), tuple(exclude), source)


class Nvfp4WeightFormats(WeightFormats):
    """NVFP4 for every linear and experts module not excluded by `config`, dense for the rest,
    multiplied in `mode` ("weight-only" or "w4a4")."""

    def __init__(self, config: Nvfp4Config, mode: str = "weight-only") -> None:
        self.config, self.mode = config, check_mode(mode)
        if mode == "w4a4" and not config.input_scales:
            raise ValueError(
                f"{config.source}: nvfp4_mode 'w4a4' needs input scales, but quant_algo is "
                f"{config.quant_algo!r} (weight-only); use nvfp4_mode='weight-only'"
            )

    def linear(self, name: str) -> LinearFormat:
        if self.config.is_excluded(name):
            return DENSE.linear
        return Nvfp4Linear(name, self.mode, self.config.input_scales)

    def experts(self, name: str) -> ExpertsFormat:
        if self.config.is_excluded(name):
            return DENSE.experts
        return Nvfp4Experts(name, self.mode, self.config.input_scales)


def checkpoint_formats(path: str | Path, nvfp4_mode: str = "weight-only") -> WeightFormats:
    """The formats checkpoint `path` declares: dense without a quantization config, else
    `Nvfp4WeightFormats` (anything other than ModelOpt NVFP4 is refused)."""
    check_mode(nvfp4_mode)
    found = read_quantization_config(path)
    if found is None:
        return WeightFormats()
    raw, source = found
    return Nvfp4WeightFormats(parse_quantization_config(raw, source), nvfp4_mode)


def checkpoint_quantization(path: str | Path, cfg: ModelConfig) -> tuple[str | None, list[int]]:
    """What checkpoint `path` declares (docs/nvfp4.md §1): ("nvfp4", the sparse layers whose experts
    its exclude list keeps unquantized) for an NVFP4 checkpoint, (None, []) for an unquantized one."""
    found = read_quantization_config(path)
    if found is None:
        return None, []
    qc = parse_quantization_config(*found)
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
    return "nvfp4", [i for i in sparse if qc.is_excluded(f"layers.{i}.mlp.experts")]
