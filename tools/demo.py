"""`make demo`: what works today, end to end, in a few seconds.

Builds a small random Muse Spark 1x checkpoint in the released format, loads it back
with `musespark.load_model` (bf16 and fp32), and greedily continues a prompt. The
serving engine (`musespark generate`) replaces this demo once it lands.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import musespark
from musespark.checkpoint import save_checkpoint
from musespark.config import ModelConfig
from musespark.model import MuseSparkForCausalLM, init_random_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a checkpoint directory (default: make a small random one)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            cfg = ModelConfig(
                vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_hidden_size=64,
                moe_intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                bos_token_id=1, eos_token_id=2, mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
            )
            model = MuseSparkForCausalLM(cfg)
            init_random_weights(model, seed=0)
            path = save_checkpoint(model.state_dict(), cfg, tmp, dtype=torch.bfloat16)
            print(f"wrote a random checkpoint to {path}: {sum(p.numel() for p in model.parameters()):,} parameters")
        start = time.perf_counter()
        model = musespark.load_model(path, dtype=args.dtype)
        print(f"loaded in {time.perf_counter() - start:.2f}s as {args.dtype}; layers: "
              f"{list(zip(model.config.layer_types, model.config.mlp_layer_types))}")
        prompt = [model.config.bos_token_id or 0, 10, 11, 12, 13]
        logits = model.prompt_logits(prompt)
        print(f"prompt {prompt} -> logits {tuple(logits.shape)} {logits.dtype}, "
              f"range [{logits.min():.2f}, {logits.max():.2f}] (soft-cap {model.config.final_logit_softcapping})")
        start = time.perf_counter()
        out = model.greedy_continuation(prompt, args.max_tokens)
        print(f"greedy continuation ({args.max_tokens} tokens, full recompute, "
              f"{time.perf_counter() - start:.2f}s): {out}")


if __name__ == "__main__":
    main()
