#!/usr/bin/env python3
"""Build a tiny, random, fully offline Llama that the vLLM CPU build can serve.

Run it with the vLLM venv's python (it needs torch, transformers and tokenizers):

    $VENV/bin/python make_tiny_llama.py OUTDIR                 # "tiny": 2 layers, 2 KV heads, head_dim 32
    $VENV/bin/python make_tiny_llama.py OUTDIR --variant fat-kv # 8 layers, 16 KV heads, head_dim 256

The weights are random (fixed seed, so the same arguments give the same files) and the tokenizer is a
word-level one built with the `tokenizers` library from a few sentences: one token per whitespace-separated
word, lower-cased, unknown words map to <unk>, and every encoded prompt starts with <s>. So a prompt of N
known words is exactly N + 1 prompt tokens, which makes max_model_len arithmetic in tests easy.

head_dim must be >= 32: the CPU attention kernels reject 16.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

SEED = 1234

# The sentences the vocabulary is made of. Changing them changes the vocabulary (and the token ids).
CORPUS = [
    "hello world this is a tiny random llama for testing context length changes",
    "the quick brown fox jumps over the lazy dog",
    "vllm serves the model and ctxmgr changes its max model len",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "tell me a story about a cat and a dog in a small house",
    "what is the answer yes no maybe please thank you",
]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
ROLE_TOKENS = ["system:", "user:", "assistant:"]
# A plain template: one "role: content" line per message, then "assistant:" when a reply is wanted.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaShape:
    """The architecture knobs; KV bytes per token are 2 * layers * kv_heads * head_dim * 4 (fp32)."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    max_position_embeddings: int


VARIANTS: dict[str, TinyLlamaShape] = {
    # 1024 bytes of KV per token in fp32: 1 GiB holds 1,048,576 tokens.
    "tiny": TinyLlamaShape(2, 4, 2, 32, 128, 256, 2048),
    # 262144 bytes (256 KiB) of KV per token: 16384 tokens need 4 GiB.
    "fat-kv": TinyLlamaShape(8, 16, 16, 256, 128, 256, 16384),
}


def build_tokenizer(outdir: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json; return the vocabulary size."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    words = sorted({word for sentence in CORPUS for word in sentence.split()})
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *ROLE_TOKENS, *words])}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(outdir / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (outdir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (outdir / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")
    return len(vocab)


def build_model(outdir: Path, shape: TinyLlamaShape, vocab_size: int) -> None:
    """Write config.json, generation_config.json and model.safetensors (random fp32 weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(outdir), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="tiny")
    parser.add_argument("--layers", type=int, help="num_hidden_layers")
    parser.add_argument("--heads", type=int, help="num_attention_heads")
    parser.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    parser.add_argument("--head-dim", type=int, help="head_dim (>= 32 for the CPU kernels)")
    parser.add_argument("--max-position-embeddings", type=int)
    args = parser.parse_args(argv)

    shape = VARIANTS[args.variant]
    overrides = {
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_position_embeddings,
    }
    shape = TinyLlamaShape(**{**asdict(shape), **{k: v for k, v in overrides.items() if v is not None}})
    if shape.head_dim < 32:
        parser.error("--head-dim must be >= 32: vLLM's CPU attention kernels reject smaller heads")
    if shape.num_attention_heads % shape.num_key_value_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    args.outdir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(args.outdir)
    build_model(args.outdir, shape, vocab_size)
    kv_bytes_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
    print(
        f"wrote {args.outdir}: {args.variant} {asdict(shape)} vocab_size={vocab_size} "
        f"kv_bytes_per_token={kv_bytes_per_token}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
