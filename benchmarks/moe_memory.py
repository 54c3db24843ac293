"""Resident memory per rank of a mixture of experts loaded at 1, 2 and 4 ranks: each rank should hold only its experts.

A Mixtral-shaped random checkpoint (8 experts, top 2) is saved once at 1 shard, then loaded by `from_pretrained` at
each rank count (gloo, one process per rank, one thread each). Each rank reports the bytes of the weights it holds
(experts and the rest), and its resident memory from /proc/self/status after loading: RssAnon (its own memory: the
weights copied out of the shards, torch's runtime) and RssFile (pages of mapped files, the shards included, which
the kernel may drop). Expert bytes per rank should be the total / ranks; the rest is whole on every rank, except
what tensor parallelism splits.

    python benchmarks/moe_memory.py --ranks 1 2 4
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def save_random_mixtral(folder: Path, args: argparse.Namespace, tokenizer: Path) -> Path:
    from accessory.checkpoint.importers.common import expected_shapes
    from accessory.checkpoint.save import save_checkpoint
    from accessory.network.LLM import model_classes

    config = dict(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=4, vocab_size=32000,
                  hidden_dim=args.hidden, moe={"num_experts": 8, "num_experts_per_tok": 2}, rope_theta=1e6)
    model_args = model_classes("mixtral")[0].from_dict(config, source="benchmark")
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) / shape[-1] ** 0.5
             for name, shape in expected_shapes(model_args, "mixtral").items()}
    return save_checkpoint(folder, state, config, 1, [tokenizer], llama_type="mixtral")


def rank_main(rank: int, world: int, port: int, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from accessory.model.meta import MetaModel

    dist.init_process_group("gloo")
    model = MetaModel.from_pretrained(folder, max_seq_len=128, max_batch_size=1)
    gc.collect()
    experts, others = held_bytes(model.llma)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {key: int(status[key].split()[0]) for key in ("VmRSS", "RssAnon", "RssFile")}
    Path(out, f"{rank}.json").write_text(json.dumps({"experts": experts, "others": others, **kib}))
    dist.barrier()
    dist.destroy_process_group()


def held_bytes(llma) -> tuple[int, int]:
    """(bytes of the experts, bytes of every other weight) this rank holds, each storage counted once (the experts'
    per-expert weights are views of their layer's stacks)."""
    storages = {}
    for name, t in [*llma.named_parameters(), *llma.named_buffers()]:
        expert = ".feed_forward." in name and ".gate." not in name  # the router is whole on every rank
        storages.setdefault(t.untyped_storage().data_ptr(), (expert, t.untyped_storage().nbytes()))
    return (sum(n for expert, n in storages.values() if expert),
            sum(n for expert, n in storages.values() if not expert))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1792, help="each expert's hidden size (Mixtral's ratio: 3.5 dim)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokenizer", help="a tokenizer.model (default: mistral-common's LLaMA-2 SentencePiece file)")
    args = p.parse_args()
    if args.tokenizer is None:
        import mistral_common
        args.tokenizer = str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")
    with tempfile.TemporaryDirectory() as work:
        tokenizer = Path(work) / "tokenizer.model"
        tokenizer.write_bytes(Path(args.tokenizer).read_bytes())
        folder = save_random_mixtral(Path(work) / "mixtral", args, tokenizer)
        print(f"Mixtral-shaped random model: dim {args.dim}, {args.layers} layers, 8 experts of hidden {args.hidden}, "
              f"top 2; weights in MiB, memory in MiB after loading")
        print("| ranks | rank | expert weights | other weights | RssAnon | RssFile | VmRSS |")
        print("|---|---|---|---|---|---|---|")
        for world in args.ranks:
            out = Path(work) / f"out{world}"
            out.mkdir()
            mp.start_processes(rank_main, args=(world, free_port(), str(folder), str(out)), nprocs=world,
                               join=True, start_method="spawn")
            for rank in range(world):
                r = json.loads((out / f"{rank}.json").read_text())
                print(f"| {world} | {rank} | {r['experts'] / 2**20:.1f} | {r['others'] / 2**20:.1f} | "
                      f"{r['RssAnon'] / 1024:.0f} | {r['RssFile'] / 1024:.0f} | {r['VmRSS'] / 1024:.0f} |", flush=True)


if __name__ == "__main__":
    main()
