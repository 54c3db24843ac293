"""How every entry point runs on a rank (the verbs, the demos, the tools): join torchrun's group, log to stderr,
load the model the same way, and leave the group cleanly; bad input exits 2 with its message, Ctrl-C 130."""
from __future__ import annotations

import logging
import os
import sys

from accessory.errors import AccessoryError, FailedInStep


def run(handler, args) -> None:
    """Run `handler(args)` on this rank as every entry point does (the verbs, the demos): join torchrun's group, log
    to stderr, and leave the group cleanly; bad input exits 2 with its message, Ctrl-C 130."""
    from accessory.parallel.context import init_distributed, leave_distributed, shutdown_distributed

    init_distributed()
    setup_logging(args)
    if getattr(args, "rank_timeout", None) is not None:
        from accessory.parallel.watchdog import start_watchdog

        start_watchdog(args.rank_timeout)
    try:
        handler(args)
    except FailedInStep as e:  # the other ranks ended normally: the closing barrier is safe
        logging.getLogger("accessory").error("%s", e)
        shutdown_distributed()
        sys.exit(2)
    except AccessoryError as e:
        logging.getLogger("accessory").error("%s", e)
        leave_distributed()
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: end quietly, as a shell expects (status 130)
        leave_distributed()
        sys.exit(130)
    except BaseException:
        from accessory.parallel.watchdog import await_verdict_on_silent_ranks

        # a collective that failed because a peer froze (killed meanwhile by another rank's watchdog): this rank's
        # watchdog is about to end it too, naming that rank, with EXIT_RANK_LOST; a traceback would come first
        await_verdict_on_silent_ranks()
        leave_distributed()
        raise
    shutdown_distributed()


def setup_logging(args) -> None:
    """Timestamped lines to stderr: rank 0's at --log-level, the other ranks' warnings and errors (all of them at
    debug)."""
    from accessory.parallel.context import world_rank

    rank = world_rank()
    level = getattr(logging, (getattr(args, "log_level", None) or "info").upper())
    quiet = rank > 0 and level > logging.DEBUG
    logging.basicConfig(stream=sys.stderr, level=max(level, logging.WARNING) if quiet else level,
                        format=f"%(asctime)s [accessory rank {rank}] %(levelname)s %(message)s")


def load_model(args, mp_group=None, warmup: bool = False):
    """Every rank loads the model (onto `mp_group`, default the world); with no --pretrained_path, the built-in one
    (imported once per node). `warmup`: with --compile, compile every graph before returning (what serves many
    requests: no request then waits on compilation)."""
    from accessory.checkpoint.default_model import ensure_default_model
    from accessory.model.meta import MetaModel
    from accessory.parallel.context import world_barrier

    paths = args.pretrained_path
    if not paths:
        keep_bits = args.quant == "int4"  # the GGUF's own Q4_1 weights, as llama.cpp runs them
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one process per node imports it; the others wait
            ensure_default_model(keep_bits)
        world_barrier()
        paths = [ensure_default_model(keep_bits)]
    model = MetaModel.from_options(load_options(args, paths, mp_group), warmup)
    if args.chat_template:
        model.tokenizer.set_chat_template(args.chat_template)
        model.stop_ids = model.tokenizer.chat_stop_ids  # EOS and the new template's end-of-turn token
    return model


def load_options(args, paths, mp_group=None):
    """The model flags of `args` (add_model_args' and serve's --lora-modules, named as LoadOptions' fields) as
    LoadOptions for `paths` on `mp_group`; a flag an entry point's parser lacks keeps LoadOptions' default."""
    from dataclasses import fields

    from accessory.runtime.load_options import LoadOptions

    given = {f.name: getattr(args, f.name) for f in fields(LoadOptions) if hasattr(args, f.name)}
    if given.get("lora_modules") is not None:
        given["lora_modules"] = dict(given["lora_modules"])  # NAME=PATH pairs
    return LoadOptions(**{**given, "pretrained_path": paths, "mp_group": mp_group})
