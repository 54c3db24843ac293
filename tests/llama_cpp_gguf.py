"""An HF model folder written as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py) writes it, for the
architectures the tests need and no converter ships in our dependencies: tensor names from gguf's own table
(`gguf.get_tensor_name_map`, llama.cpp's), a layer's experts stacked (E, out, in) per projection, llama's q/k
permuted to Meta's interleaved layout (llama.cpp's `LlamaModel.permute`; NEOX-rope architectures keep HF's), the
config as `ARCH.*` metadata, and the SentencePiece vocabulary. transformers' own GGUF reader checks the result where
it reads the architecture."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def write_llama_cpp_gguf(hf_folder: Path, path: Path, arch: gguf.MODEL_ARCH, expert_type=None) -> Path:
    """`hf_folder` (config.json, model.safetensors, tokenizer.model) as the GGUF file `path`; the experts quantized
    by gguf's quantizer as `expert_type` (a GGMLQuantizationType) if given, every other tensor float32."""
    hf = json.loads((hf_folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_config(writer, hf)
    _write_vocab(writer, hf_folder / "tokenizer.model")
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    for name, tensor in _stacked_experts(load_file(str(hf_folder / "model.safetensors"))).items():
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf["num_attention_heads"] if "q_proj" in name else hf["num_key_value_heads"]
            tensor = _permute(tensor, heads)
        data = tensor.float().numpy()
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if expert_type is not None and data.ndim == 3:
            writer.add_tensor(target, gguf.quants.quantize(data, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(writer: gguf.GGUFWriter, hf: dict) -> None:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"] if "rope_parameters" in hf else hf["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_expert_count(hf.get("num_local_experts") or hf["num_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    if "moe_intermediate_size" in hf:
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])


def _write_vocab(writer: gguf.GGUFWriter, tokenizer: Path) -> None:
    """A SentencePiece vocabulary as llama.cpp's `_set_vocab_sentencepiece` writes it."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer))
    kinds = [(sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
             (sp.is_unused, gguf.TokenType.UNUSED), (sp.is_byte, gguf.TokenType.BYTE)]
    types = [next((kind for test, kind in kinds if test(i)), gguf.TokenType.NORMAL) for i in range(sp.vocab_size())]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i).encode() for i in range(sp.vocab_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def _stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's per-expert weights `...experts.E.NAME.weight` stacked into `...experts.NAME.weight` (E, out, in), as
    the converter merges them before naming."""
    out, experts = {}, {}
    for name, tensor in weights.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{match.group(1)}.{match.group(3)}.weight", {})[int(match.group(2))] = tensor
    for name, by_id in experts.items():
        out[name] = torch.stack([by_id[e] for e in range(len(by_id))])
    return out


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: HF's rotate-half rows back to Meta's interleaved pairs, head by head."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
