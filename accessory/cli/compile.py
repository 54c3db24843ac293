"""`accessory compile`: compile a checkpoint's CPU decode step (and with --speculative-config, its verify step) ahead
of time, into the packages that every later `--compile` run with the same model and settings loads instead of
compiling (generation/packaged_steps.py)."""
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
    from accessory.generation.packaged_steps import PackagedStep

    args.compile = True
    model = load_model(args)
    engine = model.engine
    if not isinstance(engine.decode_step, PackagedStep):
        raise ConfigError(f"accessory compile makes the CPU's packages; on {model.llma.device.type}, --compile "
                          f"compiles with torch.compile in each process")
    speculation = engine.speculation
    engines = [engine] if speculation is None or speculation.draft is None else [engine, speculation.draft]
    sizes = [(e.decode_step, model.max_batch_size) for e in engines]  # --max_batch_size auto: the loaded model's pick
    if speculation is not None:  # one row's verify steps: its token and proposals (a draft catching up)
        sizes += [(e.verify_step, 1 + speculation.config.num_speculative_tokens)
                  for e in speculation.verifying_engines()]
    steps = [step for step, _ in sizes]
    paths = [path for step, most in sizes for path in step.prepare(most)]
    if model.ctx.is_source:
        print(f"key {paths[0].parent.name}: {sum(s.builds for s in steps)} compiled, "
              f"{sum(s.loads for s in steps)} already there", flush=True)
        for path in paths:
            print(path, flush=True)
