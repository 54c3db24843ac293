"""Single-turn prompt templates, drop-in for LLaMA2-Accessory's `accessory.data.system_prompt`.

The template strings are compatibility data: a model fine-tuned on one of them expects exactly these bytes, so they
are copied verbatim from LLaMA2-Accessory. Unlike the original, an unknown template name or a missing key is an error
instead of a `None` prompt or a bare `KeyError`.
"""
from __future__ import annotations

from typing import Any, Mapping

_ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)

# sys_name -> template, filled with str.format_map (so values are inserted verbatim, braces in them included).
_TEMPLATES: dict[str, str] = {
    # "alpaca" switches to _ALPACA_WITH_INPUT when format_dict has a non-blank "input".
    "alpaca": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
    "shortqa": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request using a single word or phrase.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
    "qg": "Generate a question whose answer is:\n{instruction}\n\nQuestion:\n",  # question generation
    "caption": "",  # captioning models take the image alone
    "None": "{instruction}",  # the string "None": the instruction as it is, no template
}


def template_names() -> list[str]:
    """The `sys_name` values `format_prompt` accepts."""
    return list(_TEMPLATES)


def _has_input(format_dict: Mapping[str, Any]) -> bool:
    # Accessory's rule: absent, None, empty or all-whitespace means "no input".
    return "input" in format_dict and format_dict["input"] is not None and str(format_dict["input"]).strip() != ""


def format_prompt(format_dict: Mapping[str, Any], sys_name: str = "alpaca") -> str:
    """Fill the `sys_name` template with `format_dict` (e.g. `{"instruction": ..., "input": ...}`).

    Raises ValueError for an unknown `sys_name` (listing the known ones) or when `format_dict` lacks a key the
    template needs (naming the key). Extra keys are ignored.
    """
    if not isinstance(sys_name, str) or sys_name not in _TEMPLATES:
        raise ValueError(f"unknown prompt template sys_name={sys_name!r}; known: {', '.join(template_names())}")
    template = _TEMPLATES[sys_name]
    if sys_name == "alpaca" and _has_input(format_dict):
        template = _ALPACA_WITH_INPUT
    try:
        return template.format_map(format_dict)
    except KeyError as missing:
        raise ValueError(f"prompt template {sys_name!r} needs the key {missing.args[0]!r} in format_dict, "
                         f"which has keys {list(format_dict)}") from None
