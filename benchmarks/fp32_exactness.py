"""How far would fp32 logits move if fp32 linear layers left MKL? The evidence behind keeping MKL.

    python benchmarks/fp32_exactness.py            # the five oracle configs x 2 seeds, ~1 min

For each small random config of the parity tests (tests/oracle.py), musespark's fp32
`prompt_logits` on a 64-token prompt is computed with its linear layers done three ways:

* `mkl`: `F.linear` (MKL), what musespark and transformers use in fp32;
* `fp64acc`: each dot product accumulated in float64 and rounded once, i.e. the exact fp32
  result (the best any fp32 kernel could do);
* `kernel`: the native fp32-accumulating CPU kernel (`linear_small_m`).

Reported per draw, as relative logit errors (largest |difference| / largest |reference|):
each way against `mkl` (what an optimization would change), and each way plus
transformers' fp32 against transformers run in float64 (eager experts; the exact function).
Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import musespark  # noqa: E402
import musespark.layers.linear as linear_module  # noqa: E402
from musespark.bench.common import print_json  # noqa: E402
from musespark.kernels import cpu  # noqa: E402
from oracle import CONFIGS, build_oracle, oracle_logits, relative_error, save_oracle  # noqa: E402

MKL = linear_module.linear


def fp64_accumulated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.linear(x.double(), w.double()).float()
    return MKL(x, w)


def native_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ops = cpu.native_ops()
    if x.dtype == torch.float32 and ops is not None and x.shape[-1] % 8 == 0:
        return ops.linear_small_m(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return MKL(x, w)


def use_linear(fn) -> None:
    """Route every musespark linear layer (modules and the router) through `fn`."""
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.startswith("musespark") and getattr(module, "linear", None) \
                in (MKL, fp64_accumulated, native_kernel):
            module.linear = fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    ways = {"mkl": MKL, "fp64acc": fp64_accumulated, "kernel": native_kernel}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in CONFIGS.items():
            for seed in range(args.seeds):
                ref32 = build_oracle(text, seed=seed)
                path = save_oracle(ref32, Path(tmp) / f"{name}-{seed}")
                ref64 = build_oracle(text, seed=seed).double()
                ref64.set_experts_implementation("eager")  # grouped_mm has no float64
                ours = musespark.load_model(path, dtype="float32")
                g = torch.Generator().manual_seed(seed)
                ids = torch.randint(3, ours.config.vocab_size, (args.prompt_len,), generator=g).tolist()
                truth = oracle_logits(ref64, ids).float()
                logits = {}
                for way, fn in ways.items():
                    use_linear(fn)
                    logits[way] = ours.prompt_logits(ids)
                use_linear(MKL)
                row = {"config": name, "seed": seed,
                       "vs_mkl": {w: relative_error(logits[w], logits["mkl"]) for w in ("fp64acc", "kernel")},
                       "vs_float64": {**{w: relative_error(v, truth) for w, v in logits.items()},
                                      "transformers_fp32": relative_error(oracle_logits(ref32, ids), truth)}}
                rows.append(row)
                print(f"{name:20s} seed {seed}  vs mkl: fp64acc {row['vs_mkl']['fp64acc']:.1e} "
                      f"kernel {row['vs_mkl']['kernel']:.1e} | vs float64: "
                      + " ".join(f"{w} {e:.1e}" for w, e in row["vs_float64"].items()), flush=True)
    print_json({"benchmark": "fp32_exactness", "prompt_len": args.prompt_len, "results": rows})


if __name__ == "__main__":
    main()
