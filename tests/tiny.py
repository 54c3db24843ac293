"""Small random LLaMA configs whose weights give clear greedy choices (so token equality is a real check)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

BASE = dict(dim=96, n_layers=2, vocab_size=32000, norm_eps=1e-5, max_seq_len=256)
TINY_CONFIGS = {
    # MHA; FFN hidden size 100 and vocab 32000 split unevenly over 3 ranks (zero padding path)
    "mha": dict(BASE, n_heads=12, n_kv_heads=12, hidden_dim=100, rope_theta=10000.0, rope_scaling=2.0),
    # GQA with 2 KV heads: 4 ranks replicate them; 3 ranks are refused. llama3 RoPE scaling, tied embeddings.
    "gqa": dict(BASE, n_heads=12, n_kv_heads=2, multiple_of=32, rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def tiny_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights in Meta names; scaled so activations stay O(1) and logits are well separated."""
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    args = ModelArgs(**config)
    with torch.device("meta"):
        model = Transformer(args, ParallelContext(None, 0, 1, 0))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in model.named_parameters():
        if model.checkpoint_key(name) != name:
            continue  # tied: output.weight is tok_embeddings.weight
        if "norm" in name:
            weights[name] = 1 + 0.1 * torch.randn(param.shape, generator=generator)
        elif name == "tok_embeddings.weight":
            weights[name] = 0.25 * torch.randn(param.shape, generator=generator)  # tied: also the output
        else:
            weights[name] = torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5
    return weights


def greedy_ids(model, prompts: list[list[int]], steps: int, engine=None, images=None, seeds=None, stats=None,
               **sampling) -> list[list[int]]:
    """Exactly `steps` greedy tokens per prompt (no stop tokens), straight from the engine (model.engine, or
    `engine`); the source rank's tokens, on every rank (only the source rank samples). `images`: each prompt's
    pixels or None. `seeds`: each row's (default 0), for `sampling` other than greedy. `stats`: a list the engine's
    EngineStats of the run is appended to."""
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    engine = (engine or model.engine).configured(max_batch_size=len(prompts))
    engine.stop_ids = set()
    images = images or [None] * len(prompts)
    seeds = seeds or [0] * len(prompts)
    requests = [Request(row, ids, SamplingParams(max_gen_len=steps, **sampling), seed, image=image)
                for row, (ids, image, seed) in enumerate(zip(prompts, images, seeds))]
    for _ in engine.stream(requests):
        pass
    if stats is not None:
        stats.append(engine.stats)
    return model.ctx.broadcast_object([request.generated for request in requests])


class StepRows:
    """Records the rows of every step an engine runs: each decode step's and each prefill's (its prompt count).
    Use as a context manager around the calls."""

    def __init__(self, engine):
        self.engine, self.sizes = engine, []

    def __enter__(self) -> list[int]:
        self.decode, sizes = self.engine.decode_step, self.sizes
        prefill = self.engine.model.prefill
        self.engine.decode_step = lambda tokens, *rest: (sizes.append(tokens.shape[0]), self.decode(tokens, *rest))[1]
        self.engine.model.prefill = lambda tokens, segments, *rest: (sizes.append(len(segments)),
                                                                     prefill(tokens, segments, *rest))[1]
        return sizes

    def __exit__(self, *exc) -> None:
        self.engine.decode_step = self.decode
        del self.engine.model.prefill  # the instance attribute: the class's method again


class CompiledSteps(logging.Handler):
    """What compiling the decode step makes within it, in this process: torch.compile's graphs (dynamo's count of
    unique graphs) plus the AOTInductor packages the CPU engine compiles or loads (packaged_steps.py logs each,
    its path the fourth argument; a package loaded again counts once). `count` is their sum."""

    LOGGER = "accessory.generation.packaged_steps"

    def __init__(self):
        super().__init__(logging.INFO)
        self.packages: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(("compiled the ", "loaded the compiled ")):
            self.packages.add(str(record.args[3]))

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def __enter__(self) -> "CompiledSteps":
        self.graphs_before = self.graphs()
        logger = logging.getLogger(self.LOGGER)
        self.level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self.level)
        self.graphs_made = self.graphs() - self.graphs_before

    @property
    def count(self) -> int:
        graphs = self.graphs_made if hasattr(self, "graphs_made") else self.graphs() - self.graphs_before
        return graphs + len(self.packages)


def build_tiny_llava(folder, tokenizer, tower: str = "clip"):
    """A tiny random HF LLaVA (a CLIP or SigLIP vision tower, a llama language model), saved with
    `save_pretrained` beside a LLaMA SentencePiece tokenizer: what `accessory convert hf` imports. Weights are
    scaled as `tiny_state_dict`'s (clear greedy choices), biases and positions small. Returns the HF model."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=112,
                 patch_size=14)
    vision = CLIPVisionConfig(**sizes) if tower == "clip" else SiglipVisionConfig(**sizes)
    text = LlamaConfig(hidden_size=96, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=6, vocab_size=32064, max_position_embeddings=512)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000, vision_feature_layer=-2,
                         vision_feature_select_strategy="default" if tower == "clip" else "full")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias") or "class_embedding" in name or "position_embedding" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(0.25 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param[0].numel() ** 0.5)
    model.save_pretrained(folder)
    (Path(folder) / "tokenizer.model").write_bytes(Path(tokenizer).read_bytes())
    return model


# Tiny random models of each family as transformers builds them (tests/network/test_families.py): GQA, and what each
# family has of its own (qkv bias, q/k norm with an explicit head_dim, a sliding window, Gemma's everything).
WINDOW = 24  # the sliding window of the windowed families: prompts of 60 tokens cross it
FAMILY_CONFIGS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, num_key_value_heads=1, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}


def family_config(family: str, **changes):
    """The transformers config of FAMILY_CONFIGS[family], with `changes`."""
    import transformers

    config_class, _, own = FAMILY_CONFIGS[family]
    values = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    return getattr(transformers, config_class)(**{**values, **own, **changes})


def build_tiny_family(family: str, folder, tokenizer, **changes):
    """A tiny random HF model of `family` (FAMILY_CONFIGS, with `changes` to its config), saved with
    `save_pretrained` beside a LLaMA SentencePiece tokenizer: what `accessory convert hf` imports. Weights are
    livelier than transformers' initialisation (clear greedy choices). Returns the HF model."""
    import transformers

    config = family_config(family, **changes)
    torch.manual_seed(0)
    model = getattr(transformers, FAMILY_CONFIGS[family][1])(config).eval()
    return save_lively(model, family, folder, tokenizer)


def save_lively(model, family: str, folder, tokenizer):
    """`model` with weights livelier than transformers' initialisation (clear greedy choices), saved with
    `save_pretrained` beside a LLaMA SentencePiece tokenizer."""
    config = getattr(model.config, "text_config", model.config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma stores w for a scale of 1 + w
                param.copy_((family != "gemma3") + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:  # Gemma multiplies its embeddings by sqrt(hidden_size)
                scale = 0.25 / (config.hidden_size ** 0.5 if family == "gemma3" else 1)
                param.copy_(scale * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param[0].numel() ** 0.5)
    model.save_pretrained(folder)
    (Path(folder) / "tokenizer.model").write_bytes(Path(tokenizer).read_bytes())
    return model
