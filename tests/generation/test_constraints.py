"""Structured output on both kinds of tokenizer, in one process: the tiny random model with LLaMA's SentencePiece
tokenizer (its pieces and byte tokens as llguidance reads them) and the built-in model's HF byte-level BPE. Random
weights make the model's own choices arbitrary, so every output shows the mask alone kept it to the pattern."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from accessory.generation.constraints import Constraint

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level-bpe"])
def model(request, tiny_checkpoints, smollm2_checkpoint):
    from accessory.model.meta import MetaModel

    folder = tiny_checkpoints["mha", 1] if request.param == "sentencepiece" else smollm2_checkpoint
    return MetaModel.from_pretrained(str(folder), max_seq_len=256, max_batch_size=8)


@pytest.fixture
def service(model):
    from accessory.serve.service import GenerationService

    return GenerationService(model)


def complete(model, constraint: Constraint, seeds=range(6), max_gen_len=60, bias=None) -> list:
    """The finished events of one request per seed, all decoding together (`bias`: their logit_bias)."""
    from accessory.serve.service import GenerationService

    service = GenerationService(model)
    handles = [service.submit_tokens(service.encode("Answer:"), {"max_gen_len": max_gen_len, "temperature": 1.0,
                                                                 "seed": seed, "logit_bias": bias},
                                     constraint=constraint)
               for seed in seeds]
    service.shutdown()
    service.run()
    return [[e for e in handle if e.end_of_content][0] for handle in handles]


def test_regex_and_choice(model):
    for final in complete(model, Constraint("regex", r"[0-9]{3}-[a-z]{2,4}( ok)?")):
        assert final.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( ok)?", final.text), final
    choices = ["red", "green", "blue sky"]
    texts = {final.text for final in complete(model, Constraint.choice(choices))}
    assert texts <= set(choices)


def test_json_schema_and_object(model):
    for final in complete(model, Constraint.json_schema(SCHEMA)):
        assert final.finish_reason == "stop", final
        jsonschema.validate(json.loads(final.text), SCHEMA)
    # Random weights ramble on inside a string until the limit (the test's time): a bias toward the tokens that
    # close one makes rows end their object, so the check below is never empty (the mask still decides what may
    # come; the bias is applied with it on each rank's slice)
    closing = {token: 8.0 for token in range(model.tokenizer.n_words) if '"' in model.tokenizer.decode([token])}
    finals = complete(model, Constraint("json_object"), seeds=range(3), max_gen_len=60, bias=closing)
    assert any(final.finish_reason == "stop" for final in finals), finals
    for final in finals:
        if final.finish_reason == "stop":  # random weights may ramble on inside a string until the limit
            assert isinstance(json.loads(final.text), dict)


@pytest.mark.parametrize("opened", [True, False])
def test_reasoning_then_the_answer_the_constraint_holds(model, opened):
    """after_reasoning: the reply reasons (at most 4 tokens, then "</think>" is forced), then writes what the
    pattern holds; where the prompt did not open the block, the reply may also answer at once."""
    from accessory.generation.constraints import after_reasoning

    held = after_reasoning(Constraint("regex", r"[0-9]{3}/x"), ("<think>", "</think>"), opened, budget=4)
    shape = r"(?s)(.*?)</think>\s*[0-9]{3}/x" if opened else r"(?s)(?:\s*<think>(.*?)</think>\s*)?[0-9]{3}/x"
    for final in complete(model, held, max_gen_len=40):
        assert final.finish_reason == "stop" and re.fullmatch(shape, final.text), final


def test_a_pattern_that_does_not_compile_is_named(service):
    from accessory.generation.constraints import ConstraintError

    with pytest.raises(ConstraintError, match="regex constraint cannot be compiled"):
        service.submit_tokens(service.encode("x"), {"max_gen_len": 4}, constraint=Constraint("regex", "(unclosed"))
    assert service.running == 0


FOREVER = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}  # {"c": {"c": ...}}
NO_OUTPUT = {"a $ref to itself": {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
             "required fields nesting forever": {"$defs": {"n": FOREVER}, "$ref": "#/$defs/n"}}


def test_a_constraint_that_admits_no_output_is_refused_before_decoding(service):
    """These were decoded to "" with finish_reason "stop" (or failed mid-way, a 500 over HTTP): now the first step,
    and the output every match starts with, are checked before the request is queued."""
    from accessory.generation.constraints import ConstraintError

    refused = [Constraint.json_schema(schema) for schema in NO_OUTPUT.values()]
    refused.append(Constraint("regex", r"[^\x00-\x{10FFFF}]"))  # a class that holds no character
    if service.model.tokenizer.token_text(2) == "<|im_end|>":  # ChatML's end of turn: a control token, never text
        refused.append(Constraint("regex", r"<\|im_end\|>"))
    for constraint in refused:
        with pytest.raises(ConstraintError, match=f"the {constraint.kind} constraint admits no output|grammar engine "
                                                  f"gave up on the {constraint.kind} constraint"):
            service.submit_tokens(service.encode("x"), {"max_gen_len": 4}, constraint=constraint)
    assert service.running == 0


def test_a_grammar_the_engine_gives_up_on_while_decoding_ends_the_row_with_an_error(model):
    """A choice first, then fields that nest forever: only decoding reaches them."""
    late = {"$defs": {"n": FOREVER}, "type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                                                      "n": {"$ref": "#/$defs/n"}},
            "required": ["a", "n"]}
    for final in complete(model, Constraint.json_schema(late), seeds=range(2)):
        assert final.finish_reason == "error" and final.text.startswith('{"a": "'), final
        assert final.error.startswith("ConstraintError: the grammar engine gave up on the json_schema constraint "
                                      "past its first"), final.error


def test_a_control_tokens_text_is_output_as_text_where_the_tokenizer_can_write_it(model):
    """SentencePiece writes "</s>" from the pieces "<", "/s", ">": the pattern matches that text."""
    if model.tokenizer.token_text(model.tokenizer.eos_id) != "</s>":
        pytest.skip("the byte-level BPE's <|im_end|> is refused instead (above)")
    for final in complete(model, Constraint("regex", "</s>"), seeds=range(2)):
        assert (final.finish_reason, final.text) == ("stop", "</s>")
