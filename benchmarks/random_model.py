"""A random-weight Llama with the embedded model's tokenizer, for throughput runs a trained
model's head counts do not allow.

SmolLM2-135M has 9 query and 3 KV heads, which do not split over 2 tensor-parallel ranks.
The default here is its shape with 8 query and 4 KV heads (30 layers, hidden 576, head dim
64): about the same work per token. Throughput with ``ignore_eos`` does not depend on the
weights (every configuration generates the same number of tokens, and compression keeps
the same number per head whatever it selects); quality does, so use a trained model there.

    python -m benchmarks.random_model --out .models/random-llama-kv4
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def build(out: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
          intermediate: int, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompress.models import embedded_model_dir

    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    tokenizer_dir = embedded_model_dir()
    reference = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=reference["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=reference["max_position_embeddings"],
        tie_word_embeddings=True, bos_token_id=reference["bos_token_id"],
        eos_token_id=reference["eos_token_id"], pad_token_id=reference.get("pad_token_id"),
        rope_theta=100000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, staging / name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_model",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".models/random-llama-kv4"))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.out, layers=args.layers, hidden=args.hidden, heads=args.heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim,
                 intermediate=args.intermediate, seed=args.seed)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
