"""LoadOptions is `MetaModel.from_pretrained`'s keywords as one value: the signature (LLaMA2-Accessory's, public)
and the dataclass (what the command line and the loader share) must not drift apart, and the command line's flags
must reach it under the same names.

Oracles: from_pretrained's own signature (inspect) and EngineSettings' default; argparse's parsing of the flags."""
from __future__ import annotations

import dataclasses
import inspect

from accessory.cli import build_parser
from accessory.cli.process import load_options
from accessory.generation.engine import EngineSettings
from accessory.model.meta import MetaModel
from accessory.runtime.load_options import LoadOptions


def test_from_pretrained_takes_every_option_with_the_same_default():
    """A keyword added to one and not the other, or a default changed in one place only, fails here."""
    parameters = dict(inspect.signature(MetaModel.from_pretrained).parameters)
    assert parameters.pop("warmup").default is False  # it runs after loading: not a LoadOptions field
    required = (inspect.Parameter.empty, dataclasses.MISSING)
    options = {f.name: "required" if f.default in required else f.default for f in dataclasses.fields(LoadOptions)}
    assert {name: "required" if p.default in required else p.default for name, p in parameters.items()} == options
    assert LoadOptions.prefix_cache_bytes == EngineSettings.prefix_cache_bytes


def test_the_command_lines_flags_become_the_options(tmp_path):
    args = build_parser().parse_args(["serve", "--max-seq-len", "256", "--quant", "int4", "--max_batch_size",
                                      "auto", "--no-prefix-cache", "--lora-modules", f"sql={tmp_path}"])
    options = load_options(args, [str(tmp_path)])
    assert (options.max_seq_len, options.quant, options.max_batch_size, options.prefix_cache) == (256, "int4",
                                                                                                  "auto", False)
    assert options.lora_modules == {"sql": str(tmp_path)} and options.pretrained_path == [str(tmp_path)]
    defaults = load_options(build_parser().parse_args(["generate", "--prompt", "hi"]), ["x"])
    # the flags' "none given" spellings, which mean what the keywords' do: no config files, no quantization
    assert (defaults.llama_config, defaults.quant) == ([], None)
    assert dataclasses.replace(defaults, llama_config=None, quant=False) == LoadOptions(pretrained_path=["x"])
