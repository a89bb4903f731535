"""A tiny llama-architecture GGUF model with random weights, for starting a real
``llama-server`` in tests (the point is the engine's lifecycle, not its output).

Written with the ``gguf`` package (llama.cpp's ``gguf-py``), which the tests import only
where it is installed. Shapes follow llama.cpp's llama tensors (numpy order, the reverse
of ggml's): one block, 64-wide embeddings, 4 heads, a byte-fallback SentencePiece vocab so
that any text tokenises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EMBED = 64
HEADS = 4
FF = 128
CONTEXT = 256


def write_tiny_llama(path: Path) -> Path:
    """Write the model to ``path`` and return it."""
    # Only where installed (the caller importorskips it); not a dependency of the project.
    import gguf  # type: ignore[import-not-found,unused-ignore]
    import numpy as np  # type: ignore[import-not-found,unused-ignore]

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), "▁", "a"]
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        *([gguf.TokenType.BYTE] * 256),
        gguf.TokenType.NORMAL,
        gguf.TokenType.NORMAL,
    ]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([int(t) for t in types])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def weights(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(vocab, EMBED))
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, EMBED))
    block = {
        "attn_norm.weight": np.ones(EMBED, dtype=np.float32),
        "attn_q.weight": weights(EMBED, EMBED),
        "attn_k.weight": weights(EMBED, EMBED),
        "attn_v.weight": weights(EMBED, EMBED),
        "attn_output.weight": weights(EMBED, EMBED),
        "ffn_norm.weight": np.ones(EMBED, dtype=np.float32),
        "ffn_gate.weight": weights(FF, EMBED),
        "ffn_up.weight": weights(FF, EMBED),
        "ffn_down.weight": weights(EMBED, FF),
    }
    for name, tensor in block.items():
        writer.add_tensor(f"blk.0.{name}", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
