"""Write a GLM-5 GGUF (arch `glm-dsa`) as a sparse file: real header, no tensor data.

The header carries the metadata llama.cpp's converter writes for zai-org/GLM-5 (DeepseekV2
converter + GlmMoeDsaModel: MLA stored as MQA, nextn layer counted in block_count, DSA indexer
keys, a 154,880-token vocabulary) and tensor infos for every tensor of a Q4_K_M-style
quantisation of about 8 x 51 GiB, the size the seed deployment loaded. The file is then
extended with truncate, so a 400 GiB model costs a few MB of disk.

    python examples/make_glm5_gguf.py /srv/models/GLM-5-Q4_K_M.gguf --parts 9
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# GLM-5 config.json (examples/models/glm-5/config.json)
HIDDEN = 6144
VOCAB = 154880
LAYERS = 78
NEXTN = 1
HEADS = 64
Q_LORA = 2048
KV_LORA = 512
QK_NOPE = 192
QK_ROPE = 64
V_HEAD = 256
DENSE_LAYERS = 3
INTERMEDIATE = 12288
EXPERTS = 256
EXPERTS_USED = 8
MOE_INTERMEDIATE = 2048
INDEX_HEADS = 32
INDEX_HEAD_DIM = 128
INDEX_TOPK = 2048
CONTEXT = 202752
# layers whose ffn_down_exps get one more bit, llama.cpp's Q4_K_M "use_more_bits" style
DOWN_EXPS_MORE_BITS = 16

Shape = tuple[int, ...]


def glm5_tensors() -> Iterator[tuple[str, Shape, str]]:
    """(name, numpy-order shape, ggml type) for every tensor llama.cpp writes for GLM-5."""
    yield "token_embd.weight", (VOCAB, HIDDEN), "Q6_K"
    for block in range(LAYERS + NEXTN):
        prefix = f"blk.{block}"
        yield f"{prefix}.attn_norm.weight", (HIDDEN,), "F32"
        yield f"{prefix}.attn_q_a.weight", (Q_LORA, HIDDEN), "Q8_0"
        yield f"{prefix}.attn_q_a_norm.weight", (Q_LORA,), "F32"
        yield f"{prefix}.attn_q_b.weight", (HEADS * (QK_NOPE + QK_ROPE), Q_LORA), "Q8_0"
        yield f"{prefix}.attn_kv_a_mqa.weight", (KV_LORA + QK_ROPE, HIDDEN), "Q8_0"
        yield f"{prefix}.attn_kv_a_norm.weight", (KV_LORA,), "F32"
        yield f"{prefix}.attn_k_b.weight", (HEADS, KV_LORA, QK_NOPE), "Q8_0"
        yield f"{prefix}.attn_v_b.weight", (HEADS, V_HEAD, KV_LORA), "Q8_0"
        yield f"{prefix}.attn_output.weight", (HIDDEN, HEADS * V_HEAD), "Q6_K"
        yield f"{prefix}.indexer.k_norm.weight", (INDEX_HEAD_DIM,), "F32"
        yield f"{prefix}.indexer.k_norm.bias", (INDEX_HEAD_DIM,), "F32"
        yield f"{prefix}.indexer.proj.weight", (INDEX_HEADS, HIDDEN), "F16"
        yield f"{prefix}.indexer.attn_k.weight", (INDEX_HEAD_DIM, HIDDEN), "Q8_0"
        yield f"{prefix}.indexer.attn_q_b.weight", (INDEX_HEADS * INDEX_HEAD_DIM, Q_LORA), "Q8_0"
        yield f"{prefix}.ffn_norm.weight", (HIDDEN,), "F32"
        if block < DENSE_LAYERS:
            yield f"{prefix}.ffn_gate.weight", (INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_up.weight", (INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_down.weight", (HIDDEN, INTERMEDIATE), "Q6_K"
        else:
            down = "Q5_K" if block < DENSE_LAYERS + DOWN_EXPS_MORE_BITS else "Q4_K"
            yield f"{prefix}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), "F32"
            yield f"{prefix}.exp_probs_b.bias", (EXPERTS,), "F32"
            yield f"{prefix}.ffn_gate_exps.weight", (EXPERTS, MOE_INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_up_exps.weight", (EXPERTS, MOE_INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_down_exps.weight", (EXPERTS, HIDDEN, MOE_INTERMEDIATE), down
            yield f"{prefix}.ffn_gate_shexp.weight", (MOE_INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_up_shexp.weight", (MOE_INTERMEDIATE, HIDDEN), "Q4_K"
            yield f"{prefix}.ffn_down_shexp.weight", (HIDDEN, MOE_INTERMEDIATE), "Q6_K"
        if block >= LAYERS:
            yield f"{prefix}.nextn.eh_proj.weight", (HIDDEN, 2 * HIDDEN), "Q8_0"
            yield f"{prefix}.nextn.enorm.weight", (HIDDEN,), "F32"
            yield f"{prefix}.nextn.hnorm.weight", (HIDDEN,), "F32"
            yield f"{prefix}.nextn.shared_head_norm.weight", (HIDDEN,), "F32"
    yield "output_norm.weight", (HIDDEN,), "F32"
    yield "output.weight", (VOCAB, HIDDEN), "Q6_K"


def tensor_nbytes(shape: Shape, ggml_type: str) -> int:
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]]
    return math.prod(shape) // block_size * type_size


def add_glm5_metadata(writer: Any, *, vocab: bool = True) -> None:
    """The keys llama.cpp's convert_hf_to_gguf.py + llama-quantize write for GLM-5."""
    import gguf

    w = writer
    w.add_type("model")
    w.add_name("GLM 5")
    w.add_basename("GLM")
    w.add_size_label("256x20B")
    w.add_license("mit")
    w.add_block_count(LAYERS + NEXTN)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)  # MLA written as MQA
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_used_count(EXPERTS_USED)
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_leading_dense_block_count(DENSE_LAYERS)
    w.add_vocab_size(VOCAB)
    w.add_q_lora_rank(Q_LORA)
    w.add_kv_lora_rank(KV_LORA)
    w.add_key_length(KV_LORA + QK_ROPE)
    w.add_value_length(KV_LORA)
    w.add_key_length_mla(QK_NOPE + QK_ROPE)
    w.add_value_length_mla(V_HEAD)
    w.add_expert_feed_forward_length(MOE_INTERMEDIATE)
    w.add_expert_count(EXPERTS)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(QK_ROPE)  # qk_rope_head_dim x partial_rotary_factor (1.0)
    w.add_nextn_predict_layers(NEXTN)
    w.add_indexer_head_count(INDEX_HEADS)
    w.add_indexer_key_length(INDEX_HEAD_DIM)
    w.add_indexer_top_k(INDEX_TOPK)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab:
        # Placeholder strings with the real counts, so a reader meets the same array sizes.
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("glm4")
        w.add_token_list([f"tok{i}" for i in range(VOCAB)])
        w.add_token_types([1] * (VOCAB - 100) + [3] * 100)
        w.add_token_merges([f"m{i} x{i}" for i in range(151_000)])
        w.add_eos_token_id(154820)
        w.add_pad_token_id(154820)
        w.add_bos_token_id(154822)
        w.add_chat_template("[gMASK]<sop>{% for m in messages %}{{ m.content }}{% endfor %}")


def write_sparse_gguf(
    path: Path,
    arch: str,
    tensors: list[tuple[str, Shape, str]],
    add_metadata: Callable[[Any], None],
    *,
    parts: int = 1,
) -> list[Path]:
    """Write header, metadata and tensor infos with GGUFWriter, then truncate to full size.

    With parts > 1 the tensors are spread over `PATH-0000i-of-0000N.gguf` the way
    gguf-split does: all metadata in the first part, split.* keys in every part.
    """
    import gguf
    import numpy as np

    per_part = math.ceil(len(tensors) / parts) if parts > 1 else 0
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=per_part)
    add_metadata(writer)
    for name, shape, ggml_type in tensors:
        quant = gguf.GGMLQuantizationType[ggml_type]
        writer.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(shape, ggml_type), quant)
    paths = writer.format_shard_names(path)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    ends = [fout.tell() for fout in writer.fout]
    data_sizes = [
        sum(gguf.GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment) for info in shard.values())
        for shard in writer.tensors
    ]
    writer.close()
    for part, end, data_size in zip(paths, ends, data_sizes, strict=True):
        os.truncate(part, gguf.GGUFWriter.ggml_pad(end, writer.data_alignment) + data_size)
    return paths


def write_glm5_gguf(path: Path, *, parts: int = 1, vocab: bool = True) -> list[Path]:
    return write_sparse_gguf(
        path,
        "glm-dsa",
        list(glm5_tensors()),
        lambda writer: add_glm5_metadata(writer, vocab=vocab),
        parts=parts,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "path", type=Path, help="output .gguf (with --parts: the name before -0000i-of-0000N)"
    )
    parser.add_argument("--parts", type=int, default=1, help="split into N files like gguf-split")
    parser.add_argument("--no-vocab", action="store_true", help="leave out the tokenizer arrays")
    args = parser.parse_args()
    if args.parts < 1:
        parser.error("--parts must be >= 1")
    paths = write_glm5_gguf(args.path, parts=args.parts, vocab=not args.no_vocab)
    weight_bytes = sum(tensor_nbytes(shape, kind) for _, shape, kind in glm5_tensors())
    for part in paths:
        print(f"{part}  {os.path.getsize(part) / 2**30:.2f} GiB apparent")
    gib = weight_bytes / 2**30
    print(f"tensor bytes {weight_bytes} = {gib:.1f} GiB = {gib / 8:.1f} GiB x 8")


if __name__ == "__main__":
    main()
