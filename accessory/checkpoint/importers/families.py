"""Each model family's importer mapping: how its HF folders and llama.cpp GGUF files name its tensors and config,
on top of LLaMA's (hf.py `HF_TO_META`, gguf.py `GGUF_TO_META`). Adding a family is one model file
(network/LLM/<type>.py), one `Family` here, and one test (docs/adding-a-model.md).

Canonical names beyond LLaMA's: `layers.N.attention.w{q,k,v}.bias` (qkv bias), `layers.N.attention.{q,k}_norm.weight`
(q/k norm), `layers.N.post_attention_norm.weight` and `layers.N.post_ffn_norm.weight` (sandwich norms). q and k (their
rows, biases and norm weights) are in Meta's interleaved RoPE layout, as for LLaMA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from accessory.errors import CheckpointError, ConfigError
from accessory.network.config import FIELD_RANGES
from accessory.untrusted import number, shown

QKV_BIAS_HF = {f"model.layers.{{i}}.self_attn.{p}_proj.bias": f"layers.{{i}}.attention.w{p}.bias" for p in "qkv"}
QK_NORM_HF = {f"model.layers.{{i}}.self_attn.{p}_norm.weight": f"layers.{{i}}.attention.{p}_norm.weight"
              for p in "qk"}
QKV_BIAS_GGUF = {f"blk.{{i}}.attn_{p}.bias": f"layers.{{i}}.attention.w{p}.bias" for p in "qkv"}
QK_NORM_GGUF = {f"blk.{{i}}.attn_{p}_norm.weight": f"layers.{{i}}.attention.{p}_norm.weight" for p in "qk"}


def _no_keys(hf: dict, source: str) -> dict:
    return {}


def _no_gguf_keys(meta: Callable, config: dict, source: str) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """`hf_names` / `gguf_names`: name templates (`{i}`: the layer) added to LLaMA's, or replacing its entry for the
    same canonical name. `hf_config(hf, source)` / `gguf_config(meta, config, source)`: the family's own config keys.
    `gguf_rotate_half`: llama.cpp keeps this architecture's q/k in HF's rotate-half layout (its NEOX RoPE), so they
    are permuted on import, as from HF. `gguf_norm_shift`: what llama.cpp's converter added to every norm weight."""
    llama_type: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_arch: Optional[str] = None
    hf_names: dict = field(default_factory=dict)
    gguf_names: dict = field(default_factory=dict)
    hf_config: Callable[[dict, str], dict] = _no_keys
    gguf_config: Callable[[Callable, dict, str], dict] = _no_gguf_keys
    gguf_rotate_half: bool = False
    gguf_norm_shift: float = 0.0
    # A mixture of experts' HF names (`{i}` the layer, `{e}` the expert), replacing LLaMA's dense MLP names; and the
    # fused forms transformers 5 holds in memory (`experts.gate_up_proj` (E, 2 * hidden, dim), `experts.down_proj`
    # (E, dim, hidden)), each -> the per-expert names its rows split into, in order (what save_pretrained writes).
    hf_experts: dict = field(default_factory=dict)
    hf_fused: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.hf_experts)


# ---- sliding windows, as HF configs write them ---------------------------------------------------------------------

HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def hf_windows(hf: dict, source: str, every_layer: bool) -> dict:
    """sliding_window and layer_types from an HF config (none if it has no window): its `layer_types` if it has
    them; else Qwen's use_sliding_window / max_window_layers; else (`every_layer`: Mistral) a window on every
    layer."""
    window = hf.get("sliding_window")
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        window = None
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(kind, str) for kind in types):
            raise ConfigError(f"{source}: layer_types must be a list of {list(HF_LAYER_TYPES)}, one per layer, got "
                              f"{shown(types)}")
        unknown = sorted(set(types) - set(HF_LAYER_TYPES))
        if unknown:
            raise ConfigError(f"{source}: layer_types {shown(unknown)} are not supported; expected "
                              f"{list(HF_LAYER_TYPES)}")
        types = [HF_LAYER_TYPES[kind] for kind in types]
        if window is None or "sliding" not in types:
            return {}
        return {"sliding_window": window, "layer_types": types}
    if window is None:
        return {}
    if every_layer:
        return {"sliding_window": window, "layer_types": None}
    first = hf.get("max_window_layers") or 0  # Qwen: layers from max_window_layers on slide
    return {"sliding_window": window,
            "layer_types": ["sliding" if i >= first else "full" for i in range(hf["num_hidden_layers"])]}


def _qwen_config(hf: dict, source: str) -> dict:
    if hf.get("attention_bias") is False and hf.get("model_type") == "qwen2":
        raise ConfigError(f"{source}: attention_bias is false, but Qwen2 layers have q/k/v biases")
    return hf_windows(hf, source, every_layer=False)


def _qwen3_config(hf: dict, source: str) -> dict:
    if hf.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias is true; Qwen3 layers with biases are not supported")
    return hf_windows(hf, source, every_layer=False)


def _mistral_config(hf: dict, source: str) -> dict:
    """LLaMA's and Mistral's: a window, if the config has one, on every layer."""
    return hf_windows(hf, source, every_layer=True)


def _gemma3_config(hf: dict, source: str) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention is true (an embedding model); a causal language "
                          f"model is expected")
    if hf.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"{source}: attn_logit_softcapping is {shown(hf['attn_logit_softcapping'])}; attention logit "
                          f"soft-capping (Gemma 2) is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation {shown(hf['hidden_activation'])} is not supported; Gemma 3 "
                          f"uses 'gelu_pytorch_tanh'")
    if "layer_types" not in hf and hf.get("sliding_window") is not None:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(hf["num_hidden_layers"])]}
    sliding = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if not isinstance(sliding, dict):
        raise ConfigError(f"{source}: rope_parameters.sliding_attention must be an object, got {shown(sliding)}")
    local = number(sliding.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)), source,
                   "rope_local_base_freq", ConfigError, *FIELD_RANGES["rope_local_theta"][1:])
    return {**hf_windows(hf, source, every_layer=False), "rope_local_theta": local,
            "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
            "final_logit_softcapping": hf.get("final_logit_softcapping")}


def _moe_config(hf: dict, source: str, experts_key: str, hidden_key: str, norm_topk_prob) -> dict:
    """The `moe` entry (and each expert's hidden size) of an HF MoE config."""
    experts = hf.get(experts_key, hf.get("num_local_experts", hf.get("num_experts")))
    if experts is None or "num_experts_per_tok" not in hf:
        raise ConfigError(f"{source}: a mixture of experts needs {experts_key} and num_experts_per_tok")
    if hf.get(hidden_key) is None:
        raise ConfigError(f"{source}: missing {hidden_key} (each expert's hidden size)")
    moe = {"num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"], "norm_topk_prob": norm_topk_prob}
    return {"hidden_dim": hf[hidden_key], "moe": moe}


def _mixtral_config(hf: dict, source: str) -> dict:
    return {**hf_windows(hf, source, every_layer=True),
            **_moe_config(hf, source, "num_local_experts", "intermediate_size", True)}


def _qwen3_moe_config(hf: dict, source: str) -> dict:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{source}: mlp_only_layers {shown(hf.get('mlp_only_layers'))} / decoder_sparse_step "
                          f"{shown(hf.get('decoder_sparse_step'))}: dense layers among the MoE layers are not "
                          f"supported (every layer must be a mixture: mlp_only_layers [] and decoder_sparse_step 1)")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{source}: shared experts (shared_expert_intermediate_size) are not supported")
    return {**_qwen3_config(hf, source),
            **_moe_config(hf, source, "num_experts", "moe_intermediate_size", bool(hf.get("norm_topk_prob", False)))}


MIXTRAL_HF = {"model.layers.{i}.block_sparse_moe.gate.weight": "layers.{i}.feed_forward.gate.weight",
              **{f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight":
                 f"layers.{{i}}.feed_forward.experts.{{e}}.{w}.weight" for w in ("w1", "w2", "w3")}}
MIXTRAL_FUSED = {
    "model.layers.{i}.mlp.gate.weight": ("model.layers.{i}.block_sparse_moe.gate.weight",),
    "model.layers.{i}.mlp.experts.gate_up_proj": ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
                                                  "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"),
    "model.layers.{i}.mlp.experts.down_proj": ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",),
}
QWEN_MOE_HF = {"model.layers.{i}.mlp.gate.weight": "layers.{i}.feed_forward.gate.weight",
               **{f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}_proj.weight":
                  f"layers.{{i}}.feed_forward.experts.{{e}}.{w}.weight" for hf, w in (("gate", "w1"), ("down", "w2"),
                                                                                      ("up", "w3"))}}
QWEN_MOE_FUSED = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                                                  "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
    "model.layers.{i}.mlp.experts.down_proj": ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
}


# llama.cpp's names for a mixture (every MoE architecture alike): the router, and each expert's w1 / w2 / w3. Its
# files stack a layer's experts into one `ffn_{gate,down,up}_exps` tensor (E, out, in); the importer splits them into
# these per-expert names, which llama.cpp's older Mixtral files used as they are.
MOE_GGUF = {"blk.{i}.ffn_gate_inp.weight": "layers.{i}.feed_forward.gate.weight",
            **{f"blk.{{i}}.ffn_{gguf}.{{e}}.weight": f"layers.{{i}}.feed_forward.experts.{{e}}.{w}.weight"
               for gguf, w in (("gate", "w1"), ("down", "w2"), ("up", "w3"))}}
GGUF_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _moe_gguf(meta: Callable, config: dict, source: str, arch: str) -> dict:
    """The `moe` entry (and each expert's hidden size) from a GGUF's metadata. llama.cpp renormalises the top-k
    router weights of Mixtral and Qwen3-MoE unless the file says otherwise (`expert_weights_norm`)."""
    if meta(f"{arch}.expert_shared_count", 0):
        raise ConfigError(f"{source}: {arch}.expert_shared_count is {meta(f'{arch}.expert_shared_count')}; shared "
                          f"experts are not supported")
    gating = meta(f"{arch}.expert_gating_func", GGUF_GATING_SOFTMAX)
    if gating != GGUF_GATING_SOFTMAX:
        raise ConfigError(f"{source}: {arch}.expert_gating_func is {gating}; only softmax routing "
                          f"({GGUF_GATING_SOFTMAX}) is supported")
    moe = {"num_experts": meta(f"{arch}.expert_count"), "num_experts_per_tok": meta(f"{arch}.expert_used_count"),
           "norm_topk_prob": bool(meta(f"{arch}.expert_weights_norm", True))}
    return {"hidden_dim": meta(f"{arch}.expert_feed_forward_length", config["hidden_dim"]), "moe": moe}


def _mixtral_gguf(meta: Callable, config: dict, source: str) -> dict:
    return _moe_gguf(meta, config, source, "llama")


def _qwen3_moe_gguf(meta: Callable, config: dict, source: str) -> dict:
    return {**_qwen_gguf("qwen3moe")(meta, config, source), **_moe_gguf(meta, config, source, "qwen3moe")}


def _gemma3_gguf(meta: Callable, config: dict, source: str) -> dict:
    # llama.cpp's own rules for gemma3 (src/llama-model.cpp): every sixth layer global, local RoPE base 10000, and
    # the query scale of 1 / sqrt(head_dim), except for the 27B model (62 layers), whose is 1 / sqrt(dim / heads).
    n_layers = config["n_layers"]
    scalar = config["dim"] // config["n_heads"] if n_layers == 62 else config["head_dim"]
    return {"sliding_window": meta("gemma3.attention.sliding_window"),
            "layer_types": ["sliding" if (i + 1) % 6 else "full" for i in range(n_layers)],
            "rope_local_theta": 10000.0, "query_pre_attn_scalar": float(scalar),
            "final_logit_softcapping": meta("gemma3.final_logit_softcapping", None)}


def _qwen_gguf(arch: str):
    def keys(meta: Callable, config: dict, source: str) -> dict:
        window = meta(f"{arch}.attention.sliding_window", None)
        return {} if window is None else {"sliding_window": window}
    return keys


GEMMA3_NORMS_HF = {
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_ffn_norm.weight",
}

FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), "llama", hf_config=_mistral_config),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), hf_config=_mistral_config),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", hf_names=QKV_BIAS_HF, gguf_names=QKV_BIAS_GGUF,
           hf_config=_qwen_config, gguf_config=_qwen_gguf("qwen2"), gguf_rotate_half=True),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", hf_names=QK_NORM_HF, gguf_names=QK_NORM_GGUF,
           hf_config=_qwen3_config, gguf_config=_qwen_gguf("qwen3"), gguf_rotate_half=True),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"), "gemma3",
           hf_names={**QK_NORM_HF, **GEMMA3_NORMS_HF},
           gguf_names={**QK_NORM_GGUF, "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attention_norm.weight",
                       "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_ffn_norm.weight"},
           hf_config=_gemma3_config, gguf_config=_gemma3_gguf, gguf_rotate_half=True, gguf_norm_shift=1.0),
    # llama.cpp writes Mixtral as architecture "llama" with experts
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), "llama", gguf_names=MOE_GGUF, hf_config=_mixtral_config,
           gguf_config=_mixtral_gguf, hf_experts=MIXTRAL_HF, hf_fused=MIXTRAL_FUSED),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", hf_names=QK_NORM_HF,
           gguf_names={**QK_NORM_GGUF, **MOE_GGUF}, hf_config=_qwen3_moe_config, gguf_config=_qwen3_moe_gguf,
           gguf_rotate_half=True, hf_experts=QWEN_MOE_HF, hf_fused=QWEN_MOE_FUSED),
)
HF_ARCHITECTURES = {arch: family for family in FAMILIES for arch in family.hf_architectures}
HF_MODEL_TYPES = {kind: family for family in FAMILIES for kind in family.hf_model_types}
# (general.architecture, has experts) -> family
GGUF_ARCHITECTURES = {(family.gguf_arch, family.is_moe): family for family in FAMILIES if family.gguf_arch}


def hf_family(hf: dict, source: str) -> Family:
    """The family of an HF config: by its `architectures`, or its `model_type` when it names none (a
    vision-language config's text_config)."""
    architectures, model_type = hf.get("architectures"), hf.get("model_type", "llama")
    if architectures is None and isinstance(model_type, str) and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    if not (isinstance(architectures, list) and len(architectures) == 1 and isinstance(architectures[0], str)
            and architectures[0] in HF_ARCHITECTURES):
        raise CheckpointError(f"{source}: architectures is {shown(architectures)}; these can be imported: "
                              f"{sorted(HF_ARCHITECTURES) + ['LlavaForConditionalGeneration']}")
    return HF_ARCHITECTURES[architectures[0]]


def gguf_family(architecture, n_experts: int, source: str) -> Family:
    """The family of a GGUF file, by its architecture and whether it has experts (`ARCH.expert_count`)."""
    if (architecture, n_experts > 0) not in GGUF_ARCHITECTURES:
        known = sorted({arch for arch, _ in GGUF_ARCHITECTURES})
        if architecture in known:
            raise CheckpointError(f"{source}: general.architecture {architecture!r} with expert_count {n_experts} "
                                  f"is not supported; {architecture!r} files are imported "
                                  f"{'with' if n_experts == 0 else 'without'} experts")
        raise CheckpointError(f"{source}: general.architecture is {architecture!r}; these GGUF architectures can be "
                              f"imported: {known} (Mistral's and Mixtral's files say 'llama')")
    return GGUF_ARCHITECTURES[architecture, n_experts > 0]


def without_dense_mlp(table: dict) -> dict:
    """LLaMA's name table without its dense MLP (a mixture of experts has experts instead)."""
    return {k: v for k, v in table.items() if ".feed_forward." not in v}


def with_family_names(base: dict, extra: dict) -> dict:
    """LLaMA's name table with a family's entries added, an entry for the same canonical name replacing LLaMA's."""
    replaced = set(extra.values())
    return {**{k: v for k, v in base.items() if v not in replaced}, **extra}


def qk_tensors(n_layers: int) -> list[tuple[str, str]]:
    """(canonical name, "q" or "k") of every tensor in the q/k RoPE layout: rows, biases, norm weights."""
    names = []
    for i in range(n_layers):
        for p in "qk":
            names += [(f"layers.{i}.attention.w{p}.weight", p), (f"layers.{i}.attention.w{p}.bias", p),
                      (f"layers.{i}.attention.{p}_norm.weight", "norm")]
    return names
