"""DSpark at the model level: batch-1 greedy decoding of code prompts, plain vs speculative.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/dspark.py [--prompts 8] [--new-tokens 128]

Both loops drive the bundled target (bf16, its default backend) through a paged KV cache
(musespark's AttentionContext), one request at a time:
* plain: prefill, then one target forward per token;
* dspark: prefill, then per step the draft proposes N tokens (DSparkProposer), the target runs
  [anchor, drafts] (N+1 rows; each row's attention computed as a decode row when the attention
  supports `row_wise`, so the verified logits are those of plain decoding), greedy acceptance,
  and the accepted rows' aux stream goes back to the proposer. Rejected K/V stay beyond the
  sequence length and are overwritten later.
Prompts: BOS + 63 tokens of held-out stdlib files (tools/tiny_corpus.py validation split).
The engine-level benchmark (scheduler, runner) is separate. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from musespark import load_model  # noqa: E402
from musespark.engine.spec_decode.dspark import DSparkProposer  # noqa: E402
from musespark.engine.spec_decode.proposer import ProposalRequest  # noqa: E402
from musespark.layers.attention import AttentionContext, KVGroup  # noqa: E402
from musespark.model.dspark_loader import target_forward_with_aux  # noqa: E402

MODELS = ROOT / "src" / "musespark" / "models"


class PagedTarget:
    """One sequence in a paged cache whose block table is the identity (slot = position)."""

    def __init__(self, target, max_len: int, block_size: int = 16) -> None:
        cfg = target.config
        blocks = (max_len + block_size - 1) // block_size
        shape = (blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.target, self.block_size = target, block_size
        self.kv = [
            (torch.zeros(shape, dtype=target.dtype), torch.zeros(shape, dtype=target.dtype))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.table = torch.arange(blocks)[None]

    def forward(
        self, ids: list[int], start: int, layers: tuple[int, ...], row_wise: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ids at positions [start, start+n) -> (argmax ids [n], aux [n, F])."""
        n = len(ids)
        pos = torch.arange(start, start + n)
        ctx = AttentionContext(
            query_start_loc=[0, n],
            seq_lens=[start + n],
            kv_caches=self.kv,
            groups=[KVGroup(slot_mapping=pos.clone(), block_tables=self.table)],
            layer_group=[0] * self.target.config.num_hidden_layers,
        )
        if row_wise and hasattr(ctx, "row_wise"):
            ctx.row_wise = [0]
        y, aux = target_forward_with_aux(self.target, torch.tensor(ids), pos, ctx, layers)
        return self.target.compute_logits(y).argmax(-1), aux


@torch.inference_mode()
def plain(target, prompt: list[int], new: int) -> list[int]:
    t = PagedTarget(target, len(prompt) + new + 16)
    pred, _ = t.forward(prompt, 0, ())
    out = [int(pred[-1])]
    while len(out) < new:
        pred, _ = t.forward(out[-1:], len(prompt) + len(out) - 1, ())
        out.append(int(pred[-1]))
    return out


@torch.inference_mode()
def speculative(target, proposer: DSparkProposer, prompt: list[int], new: int, n: int) -> tuple[list[int], list[int]]:
    t = PagedTarget(target, len(prompt) + new + 2 * n + 16)
    pred, aux = t.forward(prompt, 0, proposer.aux_layers)
    seq = prompt + [int(pred[-1])]
    start, rows, accepted = 0, aux, []
    while len(seq) - len(prompt) < new:
        p0 = len(seq) - 1
        drafts = proposer.propose([ProposalRequest("b", seq, start, rows, n)])[0].token_ids
        pred, aux = t.forward([seq[-1]] + drafts, p0, proposer.aux_layers, row_wise=True)
        k = 0
        while k < len(drafts) and drafts[k] == int(pred[k]):
            k += 1
        accepted.append(k)
        seq += drafts[:k] + [int(pred[k])]
        start, rows = p0, aux[: k + 1]
    proposer.drop("b")
    return seq[len(prompt) : len(prompt) + new], accepted


def code_prompts(count: int, seed: int) -> list[list[int]]:
    import tiny_corpus as tc
    from train_dspark import make_prompts

    return make_prompts(tc.load_corpus().val, count, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(MODELS / "musespark-tiny"))
    p.add_argument("--draft", default=str(MODELS / "musespark-tiny-dspark"))
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype="bfloat16")
    proposer = DSparkProposer.load(args.draft, target, args.num_speculative_tokens)
    prompts = code_prompts(args.prompts, args.seed)
    plain(target, prompts[0], 8)  # warm up both paths
    speculative(target, proposer, prompts[0], 8, args.num_speculative_tokens)
    t_plain = t_spec = 0.0
    tokens = same = 0
    accepted: list[int] = []
    for prompt in prompts:  # interleaved, so machine noise hits both alike
        t0 = time.perf_counter()
        a = plain(target, prompt, args.new_tokens)
        t1 = time.perf_counter()
        b, acc = speculative(target, proposer, prompt, args.new_tokens, args.num_speculative_tokens)
        t2 = time.perf_counter()
        t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
        tokens += len(a)
        same += int(a == b)
        accepted += acc
    n = args.num_speculative_tokens
    acc_t = torch.tensor(accepted, dtype=torch.float)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    print(
        json.dumps(
            {
                "benchmark": "dspark_model_level",
                "target": Path(args.target).name,
                "draft": Path(args.draft).name,
                "num_speculative_tokens": n,
                "prompts": len(prompts),
                "new_tokens": args.new_tokens,
                "batch": 1,
                "plain_tok_s": round(tokens / t_plain, 2),
                "dspark_tok_s": round(tokens / t_spec, 2),
                "speedup": round(t_plain / t_spec, 3),
                "identical_outputs": f"{same}/{len(prompts)}",
                "steps": len(accepted),
                "mean_accepted": round(float(acc_t.mean()), 3),
                "tokens_per_step": round(float(acc_t.mean()) + 1, 3),
                "accept_rate_by_position": [round(float((acc_t > k).float().mean()), 3) for k in range(n)],
                "machine": {
                    "platform": platform.platform(),
                    "cpu_count": __import__("os").cpu_count(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": args.threads,
                },
                "commit": commit,
                "seed": args.seed,
            }
        )
    )


if __name__ == "__main__":
    main()
