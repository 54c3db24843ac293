"""`accessory compile`: compile a checkpoint's CPU decode step ahead of time, into the packages that every later
`--compile` run with the same model and settings loads instead of compiling (generation/packaged_decode.py)."""
from __future__ import annotations

from accessory.cli.options import add_model_args
from accessory.cli.process import load_model
from accessory.errors import ConfigError


def add_compile_verb(verbs) -> None:
    verb = verbs.add_parser("compile", help="compile the CPU decode step once, for every later --compile run of this "
                            "model and settings (the same model flags as generate)")
    add_model_args(verb)
    verb.set_defaults(handler=run_compile)


def run_compile(args) -> None:
    from accessory.generation.packaged_decode import PackagedDecode

    args.compile = True
    model = load_model(args)
    step = model.engine.decode_step
    if not isinstance(step, PackagedDecode):
        raise ConfigError(f"accessory compile makes the CPU's packages; on {model.llma.device.type}, --compile "
                          f"compiles with torch.compile in each process")
    paths = step.prepare(model.max_batch_size)  # --max_batch_size auto: the loaded model's pick
    if model.ctx.is_source:
        print(f"key {paths[0].parent.name}: {step.builds} compiled, {step.loads} already there", flush=True)
        for path in paths:
            print(path, flush=True)
