"""fp32 exactness: how far from a float64 evaluation are musespark's fp32 logits, per path?

    python benchmarks/fp32_exactness.py            # the five oracle configs x 2 seeds, ~1 min

The rule (docs/exactness.md, rule 4): an fp32 kernel is acceptable when, over the oracle-parity
configurations, the largest relative logit error of our fp32 model against a float64
evaluation of the same model is no larger than that of the PyTorch/MKL fp32 path.

For each small random config of the parity tests (tests/oracle.py), musespark's fp32
`prompt_logits` on a 64-token prompt is computed three ways:

* `mkl`: the torch backend, linears by `F.linear` (MKL), what transformers computes;
* `fp64acc`: the torch backend with each dot product accumulated in float64 and rounded
  once (the exact fp32 product: the best any fp32 GEMM could do);
* `cpu`: the cpu backend's native fp32 blocks on every row (what fp32 decode steps run:
  kernels/csrc/blocks/ffn_block.cpp etc., fp32 weights accumulated in double).

Reported per draw, as relative logit errors (largest |difference| / largest |reference|):
each way against `mkl`, and each way plus transformers' fp32 against transformers run in
float64 (eager experts; the exact function); then the largest error per way over every
draw and whether the rule holds. Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from oracle import CONFIGS, build_oracle, oracle_logits, relative_error, save_oracle  # noqa: E402

import musespark  # noqa: E402
import musespark.layers.linear as linear_module  # noqa: E402
from musespark.backends import select_backend  # noqa: E402
from musespark.bench.common import print_json  # noqa: E402
from musespark.kernels import cpu  # noqa: E402

MKL = linear_module.linear


def fp64_accumulated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.linear(x.double(), w.double()).float()
    return MKL(x, w)


def fused_fp32_everywhere(backend) -> None:
    """The cpu backend's fp32 blocks on every row (they serve decode-sized steps only; a
    prompt is where their numerics can be compared with float64 position by position)."""
    if backend.name == "cpu":
        backend.plan = replace(backend.plan, fp32_fused_max_rows=1 << 30)


def use_linear(fn) -> None:
    """Route every musespark linear layer (modules and the router) through `fn`."""
    for module in list(sys.modules.values()):
        if (
            module is not None
            and module.__name__.startswith("musespark")
            and getattr(module, "linear", None) in (MKL, fp64_accumulated)
        ):
            module.linear = fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    # way -> (backend, linear function of the torch backend's modules)
    ways = {"mkl": ("torch", MKL), "fp64acc": ("torch", fp64_accumulated), "cpu": ("cpu", MKL)}
    if cpu.native_ops() is None:
        del ways["cpu"]
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
                for way, (backend, fn) in ways.items():
                    use_linear(fn)
                    ours.backend = select_backend(backend, ours)
                    fused_fp32_everywhere(ours.backend)
                    logits[way] = ours.prompt_logits(ids)
                use_linear(MKL)
                row = {
                    "config": name,
                    "seed": seed,
                    "vs_mkl": {w: relative_error(logits[w], logits["mkl"]) for w in ways if w != "mkl"},
                    "vs_float64": {
                        **{w: relative_error(v, truth) for w, v in logits.items()},
                        "transformers_fp32": relative_error(oracle_logits(ref32, ids), truth),
                    },
                }
                rows.append(row)
                print(
                    f"{name:20s} seed {seed}  vs mkl: "
                    + " ".join(f"{w} {e:.1e}" for w, e in row["vs_mkl"].items())
                    + " | vs float64: "
                    + " ".join(f"{w} {e:.1e}" for w, e in row["vs_float64"].items()),
                    flush=True,
                )
    worst = {w: max(r["vs_float64"][w] for r in rows) for w in rows[0]["vs_float64"]}
    print("largest error vs float64 over every draw: " + " ".join(f"{w} {e:.2e}" for w, e in worst.items()))
    if "cpu" in worst:
        print(f"rule (cpu no further from float64 than mkl): {'holds' if worst['cpu'] <= worst['mkl'] else 'FAILS'}")
    print_json(
        {
            "benchmark": "fp32_exactness",
            "prompt_len": args.prompt_len,
            "results": rows,
            "largest_vs_float64": worst,
            "kernel_path": cpu.kernel_path(),
        }
    )


if __name__ == "__main__":
    main()
