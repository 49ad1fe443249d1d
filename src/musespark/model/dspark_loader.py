"""Reading and writing DSpark draft checkpoints (docs/speculative.md §3), and the target-side aux
stream (§6) for callers that run the target themselves (training, tests, benchmarks).

A draft directory holds `config.json` (`muse_spark_dspark`) and `model.safetensors` (or
several `*.safetensors` files). Names may carry a `model.` prefix (everything but `lm_head*`
and `d2t`) or not; the DFlash aliases `encoder.fc`, `encoder.output_norm_enc` and `midlayer`
are accepted. `embed_tokens.weight`, `mask_embedding` and `t2d` are ignored; any other
unexpected name, a missing one (`lm_head.weight` and `d2t` included) or a wrong shape is a
`ValueError` naming it. Weights are read in D, the confidence head in fp32, d2t as int64.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint.safetensors_file import SafetensorsFile
from ..layers.attention import AttentionContext
from .dspark import DSparkDraft
from .dspark_config import DSparkConfig

IGNORED_TENSORS = ("embed_tokens.weight", "mask_embedding", "t2d")
ALIASES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."), ("midlayer.", "layers.0."))


def canonical_name(name: str) -> str:
    """Checkpoint name -> module name: drop `model.`, apply the DFlash aliases."""
    if name.startswith("model."):
        name = name[len("model.") :]
    for old, new in ALIASES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_draft(
    path: str | Path, target_num_layers: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> DSparkDraft:
    """Build the draft of `path` for a target with `target_num_layers` layers, in eval mode."""
    path = Path(path)
    cfg = DSparkConfig.from_file(path)
    with torch.device("meta"):
        model = DSparkDraft(cfg, target_num_layers)
    want = model.state_dict()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in files:
        with SafetensorsFile(file) as st:
            for raw in st.entries:
                name = canonical_name(raw)
                if name in IGNORED_TENSORS or name.startswith("embed_tokens."):
                    continue
                if name not in want:
                    unexpected.append(raw)
                    continue
                spec = want[name]
                shape = tuple(st.entries[raw].shape)
                if shape != tuple(spec.shape):
                    raise ValueError(f"{path}: tensor {raw!r} has shape {list(shape)}, expected {list(spec.shape)}")
                out_dtype = (
                    torch.long if name == "d2t" else (torch.float32 if name.startswith("confidence_head.") else dtype)
                )
                state[name] = st.read(raw, out_dtype).to(device)
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"{path}: draft checkpoint lacks tensor(s) {missing}")
    if unexpected:
        raise ValueError(f"{path}: unexpected tensor(s) in draft checkpoint {sorted(unexpected)}")
    model.load_state_dict(state, strict=True, assign=True)
    d2t = model.d2t
    targets = torch.arange(len(d2t), device=d2t.device) + d2t
    if bool(((targets < 0) | (targets >= cfg.vocab_size)).any()):
        raise ValueError(f"{path}: d2t maps draft ids outside [0, {cfg.vocab_size})")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def save_draft(
    model: DSparkDraft, path: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None
) -> Path:
    """Write config.json + model.safetensors (weights in `dtype`, confidence head fp32, d2t int64)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name == "d2t":
            tensors[name] = t.long().contiguous()
        elif name.startswith("confidence_head."):
            tensors[name] = t.float().contiguous()
        else:
            tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict() | (extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def target_forward_with_aux(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
    layer_ids: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward (one process, no pipeline) that also returns the fp32 stream
    after each decoder layer in `layer_ids` (the tensor entering the next layer), ascending:
    -> (y [T, H] in the model dtype, aux [T, len(layer_ids) * H] fp32). Uses the model's own
    `forward(..., aux_layers=...)` when it has one, else runs the layers here."""
    if layer_ids and "aux_layers" in inspect.signature(target.forward).parameters:
        return target(input_ids, positions, ctx, aux_layers=tuple(layer_ids))
    dtype, backend = target.dtype, target._active_backend()
    s = backend.embed(target, input_ids)
    rope: dict = {}
    aux = []
    wanted = set(layer_ids)
    for i in range(target.config.num_hidden_layers):
        s = target.layers[i].forward(s, positions, ctx, rope, backend, dtype)
        if i in wanted:
            aux.append(s.to(torch.float32, copy=True))  # a copy: a backend may update s in place
    rows = torch.cat(aux, dim=-1) if aux else s.new_zeros(s.shape[0], 0, dtype=torch.float32)
    return backend.final_norm(target, s, dtype), rows
