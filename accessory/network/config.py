"""A model's configuration: `ModelArgs`, the hyper-parameters read from params.json / config.json, checked field by
field (a bad value is a ConfigError naming the key and what was expected) before anything is built; families
subclass it (network/LLM/<type>.py). `MoEConfig` is a mixture of experts' part of it.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from accessory.errors import ConfigError
from accessory.untrusted import shown

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts: `num_experts` gated feed-forwards, of which a router picks `num_experts_per_tok` per
    token (softmax over all experts, then the top k; their weights renormalised to sum to 1 if `norm_topk_prob`:
    Mixtral always, Qwen3-MoE as its config says)."""
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True


# Keys older config files carry that are engine settings, not the model's (MetaModel.from_pretrained takes them).
ENGINE_KEYS = ("max_batch_size",)


def without_engine_keys(values: dict, source: str) -> dict:
    found = [key for key in ENGINE_KEYS if key in values]
    if found:
        log.info("%s: %s is an engine setting (from_pretrained / --max_batch_size); the file's value is not used",
                 source, ", ".join(found))
    return {k: v for k, v in values.items() if k not in ENGINE_KEYS}


# Each numeric field's type and inclusive range, checked in every config file before anything is built. The bounds
# are far beyond any real model (Llama-3.1-405B: dim 16384, 126 layers, vocab 128256, hidden 53248): they stop a
# config from asking for impossible sizes, and memory is checked separately (check_memory).
FIELD_RANGES = {
    "dim": (int, 1, 1 << 17), "n_layers": (int, 1, 1024), "n_heads": (int, 1, 1 << 12),
    "n_kv_heads": (int, 1, 1 << 12), "vocab_size": (int, -1, 1 << 24), "multiple_of": (int, 1, 1 << 17),
    "ffn_dim_multiplier": (float, 1e-3, 64.0), "hidden_dim": (int, 1, 1 << 20), "norm_eps": (float, 1e-30, 0.1),
    "rope_theta": (float, 1.0, 1e12), "max_seq_len": (int, 1, 1 << 24), "head_dim": (int, 2, 1 << 12),
    "sliding_window": (int, 1, 1 << 24), "rope_local_theta": (float, 1.0, 1e12),
    "query_pre_attn_scalar": (float, 1e-6, 1e9), "final_logit_softcapping": (float, 1e-6, 1e9),
    "load_balancing_weight": (float, 0.0, 1e6),
}
MOE_KEYS = {"num_experts": (int, 1, 1 << 12), "num_experts_per_tok": (int, 1, 1 << 12), "norm_topk_prob": (bool,)}
LAYER_TYPES = ("full", "sliding")


def field_problem(name: str, value, type_name: Optional[str]) -> Optional[str]:
    """Why `value` cannot be config field `name` (whose dataclass annotation is `type_name`), or None."""
    if value is None and name in ("n_kv_heads", "ffn_dim_multiplier", "hidden_dim", "rope_scaling", "head_dim",
                                  "sliding_window", "layer_types", "rope_local_theta", "query_pre_attn_scalar",
                                  "final_logit_softcapping"):
        return None
    if name == "moe":
        return moe_problem(value)
    if name == "rope_scaling":
        return rope_scaling_problem(value)
    if name == "layer_types":
        ok = isinstance(value, list) and all(kind in LAYER_TYPES for kind in value)
        return None if ok else f"must be a list of {list(LAYER_TYPES)}, one per layer, got {shown(value)}"
    if type_name == "bool":
        return range_problem(value, bool)
    if name not in FIELD_RANGES:
        return None
    problem = range_problem(value, *FIELD_RANGES[name])
    if name == "vocab_size" and (value == 0 or problem):
        return f"must be an integer in [1, {FIELD_RANGES[name][2]}] (or -1: from the tokenizer), got {shown(value)}"
    return problem


def range_problem(value, kind: type, low=None, high=None) -> Optional[str]:
    """Why `value` is not a `kind` (bool; int or float in [low, high], NaN never), or None."""
    if kind is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {shown(value)}"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (kind is int and not isinstance(value, int)) or value != value:
        return f"must be {'an integer' if kind is int else 'a number'} in [{low}, {high}], got {shown(value)}"
    if not low <= value <= high:
        return f"must be in [{low}, {high}], got {shown(value)}"
    return None


# Meta's LLaMA-3.1 llama3 rope-scaling constants (3.1 / 3.2 / 3.3 differ only in the factor): what a config that says
# only `use_scaled_rope`, or only the factor, means; and what llama.cpp's rope_freqs tensor was computed with.
LLAMA3_ROPE_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
# Each rope_type's keys in a rope_scaling dict: those it needs, and those it may have (llama3's missing ones take
# Meta's LLaMA-3.1 values, LLAMA3_ROPE_DEFAULTS).
ROPE_SCALING_KEYS = {
    "linear": ({"factor"}, set()),
    "llama3": (set(), {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
# Each rope-scaling value's type and inclusive range. Factors divide frequencies (or scale cos and sin), so they are
# finite and > 0; yarn's mscales may be 0 (off); the bounds are far beyond any real model's.
ROPE_VALUE_RANGES = {
    "factor": (float, 1e-6, 1e6), "low_freq_factor": (float, 1e-6, 1e6), "high_freq_factor": (float, 1e-6, 1e6),
    "original_max_position_embeddings": (int, 1, 1 << 24), "attention_factor": (float, 1e-6, 1e6),
    "beta_fast": (float, 1e-6, 1e6), "beta_slow": (float, 1e-6, 1e6), "mscale": (float, 0.0, 1e6),
    "mscale_all_dim": (float, 0.0, 1e6), "truncate": (bool,),
}


def rope_scaling_problem(value) -> Optional[str]:
    """Why `value` cannot be `rope_scaling` (None; a number: LLaMA2-Accessory's linear factor; or a dict naming its
    `rope_type` (or HF's older `type`) and that type's keys, ROPE_SCALING_KEYS), or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return range_problem(value, *ROPE_VALUE_RANGES["factor"])
    if not isinstance(value, dict):
        return f"must be null, a linear factor or a dict with a rope_type, got {shown(value)}"
    kind = value.get("rope_type", value.get("type"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        return f"rope_type must be one of {sorted(ROPE_SCALING_KEYS)}, got {shown(kind)}"
    needed, optional = ROPE_SCALING_KEYS[kind]
    given = set(value) - {"rope_type", "type"}
    if needed - given:
        return f"{kind} scaling lacks key(s) {sorted(needed - given)}"
    if given - needed - optional:
        return (f"{kind} scaling has unknown key(s) {sorted(given - needed - optional, key=str)}; it takes "
                f"{sorted(needed | optional)}")
    for key in sorted(given):
        problem = range_problem(value[key], *ROPE_VALUE_RANGES[key])
        if problem:
            return f"{kind} {key} {problem}"
    return llama3_problem(value) if kind == "llama3" else None


def llama3_problem(scaling: dict) -> Optional[str]:
    """Why llama3 scaling's frequency band is empty (its blend divides by high_freq_factor - low_freq_factor)."""
    values = {**LLAMA3_ROPE_DEFAULTS, **scaling}
    low, high = values["low_freq_factor"], values["high_freq_factor"]
    if low >= high:
        return f"llama3 low_freq_factor ({low}) must be less than high_freq_factor ({high})"
    return None


def moe_problem(value) -> Optional[str]:
    """Why `value` cannot be a `moe` config entry ({"num_experts": E, "num_experts_per_tok": k, optionally
    "norm_topk_prob": true/false}), or None."""
    expected = (f'must be {{"num_experts": E, "num_experts_per_tok": k (<= E)[, "norm_topk_prob": true|false]}}, '
                f'got {shown(value)}')
    if not isinstance(value, dict) or not {"num_experts", "num_experts_per_tok"} <= set(value) <= set(MOE_KEYS):
        return expected
    for key, item in value.items():
        kind, *bounds = MOE_KEYS[key]
        if kind is bool and not isinstance(item, bool):
            return f"{key} must be true or false, got {shown(item)}"
        if kind is int and (not isinstance(item, int) or isinstance(item, bool) or not bounds[0] <= item <= bounds[1]):
            return f"{key} must be an integer in [{bounds[0]}, {bounds[1]}], got {shown(item)}"
    if value["num_experts_per_tok"] > value["num_experts"]:
        return f"num_experts_per_tok ({value['num_experts_per_tok']}) exceeds num_experts ({value['num_experts']})"
    return None


@dataclass
class ModelArgs:
    """Model hyper-parameters, as read from params.json / config.json.

    Head counts have one meaning each: `n_heads` and `n_kv_heads` are global; `n_local_heads` and
    `n_local_kv_heads` (per model-parallel rank, which may differ between ranks: whole GQA groups spread unevenly)
    live on the attention module; `n_rep = n_heads // n_kv_heads` is how
    many query heads share one KV head.

    A family's traits are class attributes, not config keys (a config cannot make LLaMA into Qwen3): a family's
    ModelArgs overrides them, and adds the config keys only it has.
    """
    qkv_bias: ClassVar[bool] = False  # wq, wk, wv have biases (Qwen2)
    qk_norm: ClassVar[bool] = False  # an RMSNorm over each head's q and k, before RoPE (Qwen3, Gemma 3)
    hidden_act: ClassVar[str] = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_offset: ClassVar[float] = 0.0  # RMSNorm scales by (norm_offset + weight) (Gemma: 1)
    sandwich_norms: ClassVar[bool] = False  # norms after attention and after the MLP too (Gemma)

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no GQA)
    vocab_size: int = -1  # -1: taken from the tokenizer (Meta's LLaMA-2 params.json says -1)
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    hidden_dim: Optional[int] = None  # explicit SwiGLU hidden size (HF `intermediate_size`); overrides the rule
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None; a float (LLaMA2-Accessory's linear position scaling factor); or a dict with "rope_type" "linear"
    # ({"factor"}) or "llama3" ({"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}).
    rope_scaling: Union[None, float, dict] = None
    use_scaled_rope: bool = False  # Meta's LLaMA-3.1 params.json flag: llama3 scaling with Meta's defaults
    tie_word_embeddings: bool = False  # output projection shares tok_embeddings' weight (no `output` tensor saved)
    max_seq_len: int = 2048  # positions the rotary table covers; from_pretrained sets it
    load_pretrained_visual_encoder: bool = False  # LLaMA2-Accessory training flag; no effect on inference
    head_dim: Optional[int] = None  # None: dim / n_heads (Mistral-Nemo, Qwen3 and Gemma 3 set their own)
    # Sliding-window attention: on the layers `layer_types` says "sliding" (all of them if it is None), each token
    # attends to the last `sliding_window` positions (itself included). None: every layer attends to everything.
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # "full" or "sliding", per layer

    def __post_init__(self):
        self.check_values(self.to_dict())
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or head_dim "
                                  f"given")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for n_layers {self.n_layers}")
        scaling = self.rope_scaling if isinstance(self.rope_scaling, dict) else {}
        if scaling.get("rope_type", scaling.get("type")) == "yarn" and self.rope_theta <= 1:
            raise ConfigError(f"rope_theta ({self.rope_theta}) must be > 1 with yarn rope scaling (its ramp divides "
                              f"by log(rope_theta))")

    @classmethod
    def check_keys(cls, values: dict, source: str) -> None:
        """Reject unknown keys, naming them and the file they came from."""
        known = {f.name for f in dataclasses.fields(cls)} | set(ENGINE_KEYS)
        unknown = sorted(set(values) - known)
        if unknown:
            hint = ""
            if "hidden_size" in values or "architectures" in values:
                hint = " This looks like a Hugging Face model folder: import it with `accessory convert hf SRC DST`."
            raise ConfigError(f"{source}: unknown model config key(s) {unknown}; known keys: {sorted(known)}.{hint}")

    @classmethod
    def check_values(cls, values: dict, source: Optional[str] = None) -> None:
        """Reject a value of the wrong type or out of range, naming the file, the field and what it must be."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, value in values.items():
            problem = field_problem(name, value, types.get(name))
            if problem:
                raise ConfigError(f"{source + ': ' if source else ''}{name} {problem}")

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "ModelArgs":
        values = without_engine_keys(values, source)
        cls.check_keys(values, source)
        try:  # __post_init__ checks the values
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer`, or None (it attends to every position)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] == "full"):
            return None
        return self.sliding_window

    def rope(self, window: Optional[int]) -> tuple[float, Union[None, float, dict]]:
        """(theta, scaling) of the rotary embedding of a layer with that window (Gemma 3 gives sliding layers
        their own base)."""
        if self.use_scaled_rope and self.rope_scaling is None:
            return self.rope_theta, {"rope_type": "llama3"}  # Meta's LLaMA-3.1 defaults (LLAMA3_ROPE_DEFAULTS)
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.head_dim ** -0.5

    @property
    def embedding_scale(self) -> Optional[float]:
        """The embeddings are multiplied by this (in the model's dtype), or None."""
        return None

    @property
    def logit_softcap(self) -> Optional[float]:
        """Final logits become cap * tanh(logits / cap), or None."""
        return None

    @property
    def experts(self) -> Optional[MoEConfig]:
        """The mixture of experts every layer's feed-forward is (mixtral, qwen3_moe), or None: a dense MLP."""
        return None

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)  # Meta's SwiGLU rule
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def allowed_parallel_sizes(self, limit: int = 64) -> list[int]:
        return [n for n in range(1, limit + 1) if not self.parallel_size_problem(n)]

    def parallel_size_problem(self, world: int) -> Optional[str]:
        """Why this model cannot run at `world` model-parallel ranks, or None if it can."""
        # Heads go in whole GQA groups, unevenly where needed (parallel/layers.py head_placement).
        if world > self.n_heads:
            return f"n_heads ({self.n_heads}) is less than the model-parallel size ({world}): each rank needs a head"
        if world > self.n_kv_heads and world % self.n_kv_heads:
            return (f"the model-parallel size ({world}) is more than n_kv_heads ({self.n_kv_heads}) but not a "
                    f"multiple of it (beyond one KV head per rank, each KV head is copied on as many ranks)")
        if self.dim % world:
            return f"dim ({self.dim}) is not divisible by the model-parallel size ({world}) (the embedding's split)"
        return None

    def check_parallel_size(self, world: int) -> None:
        problem = self.parallel_size_problem(world)
        if problem:
            raise ConfigError(f"cannot run this model at {world} model-parallel ranks: {problem}; "
                              f"it runs at {self.allowed_parallel_sizes()} ranks")
