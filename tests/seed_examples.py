"""LLaMA2-Accessory's own inference examples (its docs/inference.md, "Input Construction & Response Generation"), run
as a user runs them: one script that every rank runs, plainly or under torchrun. The changes for this machine: the
checkpoint path, max_gen_len 8 instead of 512 (the suite's time; the multi-turn answer meets its separator at 7),
and each example's result kept (OUT/<rank>.json) beside the doc's print, so a test can compare the ranks. No
process-group set-up, no barrier at the end: the doc's scripts have neither, and must run as they are.

Usage: [torchrun --nproc-per-node=N] python seed_examples.py CHECKPOINT OUT
"""
import json
import os
import sys

from accessory.data.conversation import default_conversation
from accessory.data.system_prompt import format_prompt
from accessory.model.meta import MetaModel

CHECKPOINT, OUT = sys.argv[1], sys.argv[2]
MAX_GEN_LEN = 8
results = {}

model = MetaModel.from_pretrained(CHECKPOINT, max_seq_len=2048)

# ---- Pretrained models ----
prompt = "The best programming language in the world is"
response = model.generate([prompt], images=None, max_gen_len=MAX_GEN_LEN)[0]
print(response)
results["pretrained generate"] = response
response = None
for response_in_progress in model.stream_generate(prompt, image=None, max_gen_len=MAX_GEN_LEN):
    response = response_in_progress['text']
print(response)
results["pretrained stream"] = response

# ---- Single-turn-finetuned models (the alpaca template) ----
instruction = "What's the best programming language in the world?"
prompt = format_prompt({"instruction": instruction}, sys_name="alpaca")
response = model.generate([prompt], images=None, max_gen_len=MAX_GEN_LEN)[0]
print(response)
results["alpaca generate"] = response
response = None
for response_in_progress in model.stream_generate(prompt, image=None, max_gen_len=MAX_GEN_LEN):
    response = response_in_progress['text']
print(response)
results["alpaca stream"] = response

# ---- Multi-turn-finetuned models ----
conv = default_conversation()
q1 = "What's the best programming language in the world?"
a1 = "The best programming language in the world in PHP."
q2 = "Are you sure? Why not Python?"
qas = [[q1, a1], [q2, None]]
conv.load_qas(qas)
prompt = conv.get_prompt()
conv_sep = conv.response_end_signal
results["multi-turn prompt"] = prompt

# ------EITHER-------
response = None
for response_in_progress in model.stream_generate(
        prompt, image=None, max_gen_len=MAX_GEN_LEN, additional_stop_symbols=[conv_sep]
):
    response = response_in_progress['text']
print(response)
results["EITHER"] = response


# --------OR--------- (the loop that leaves the stream early; twice, with the separator the issue used, ".", so that
# it does break out on this model, then the group generates again)
def the_or_loop(conv_sep):
    response = None
    for response_in_progress in model.stream_generate(prompt, image=None, max_gen_len=MAX_GEN_LEN):
        sep_pos = response_in_progress["text"].find(conv_sep)
        if sep_pos != -1:
            response = response_in_progress["text"][:sep_pos]
            break
        else:
            response = response_in_progress["text"]
    print(response)
    return response


results["OR"] = the_or_loop(conv_sep)
results["OR '.'"] = [the_or_loop("."), the_or_loop(".")]
results["generate after"] = model.generate([prompt], max_gen_len=8)[0]
# (beyond the doc) every field of a stream's events, which every rank must see alike too
results["events"] = [[e.text, e.delta, e.end_of_content, e.finish_reason, e.completion_tokens]
                     for e in model.stream_generate("The moon is", max_gen_len=6)]

with open(os.path.join(OUT, f"{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(results, f)
