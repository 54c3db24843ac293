"""LLaMA2-Accessory's multi-GPU example (its docs/inference.md, "Multi-GPU Inference with Model Parallelism") as a
user runs it: `mp.Process` per rank with spawn, the process group set up by the script, `mp_group` passed in, no
barrier or destroy_process_group at the end, and the parent not joining its children. The changes for the CPU: gloo
instead of NCCL (no `torch.cuda.set_device`), a free port and the rank count from the command line instead of 23560
and N_GPU = 2, max_gen_len 8 (seed_examples.py's), and each rank's streamed texts kept (OUT/<rank>.json) beside the
doc's print.

Usage: python seed_mp_example.py CHECKPOINT OUT N_RANKS PORT
"""
import json
import os
import sys

from accessory.model.meta import MetaModel
from accessory.data.system_prompt import format_prompt

import random
import numpy as np

import torch
import torch.distributed as dist
import multiprocessing as mp

CHECKPOINT, OUT, N_RANKS, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def main(world_size, rank) -> None:
    random.seed(0)
    torch.random.manual_seed(0)
    np.random.seed(0)
    torch.set_num_threads(1)  # ranks share this machine's cores

    dist.init_process_group(
        backend="gloo", rank=rank, world_size=world_size,
        init_method=f"tcp://127.0.0.1:{PORT}",
    )

    model = MetaModel.from_pretrained(CHECKPOINT, max_seq_len=2048,
                                      mp_group=dist.new_group(ranks=list(range(dist.get_world_size()))))

    instruction = "What's the best programming language in the world?"
    prompt = format_prompt({"instruction": instruction}, sys_name="alpaca")

    response, streamed = None, []
    for response_in_progress in model.stream_generate(prompt, image=None, max_gen_len=8):
        response = response_in_progress['text']
        print(response)
        streamed.append(response)
    with open(os.path.join(OUT, f"{rank}.json"), "w") as f:
        json.dump(streamed, f)


if __name__ == "__main__":
    N_GPU = N_RANKS
    if N_GPU == 1:
        main(world_size=1, rank=0)
    elif N_GPU > 1:
        mp.set_start_method("spawn")
        for rank in range(N_GPU):
            process = mp.Process(target=main, args=(N_GPU, rank))
            process.start()
    else:
        raise ValueError
