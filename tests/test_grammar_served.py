"""Structured output served: the Triton inputs (TensorRT-LLM's guided_decoding_*) through the orchestrator."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specdec.grammar import GrammarCompiler
from specdec.speculation_length import SpeculationLength
from specdec_triton.plumbing import RequestError
from local_orchestrator import codec, engine_text, make_orchestrator, models, request, run, text_of

__all__ = ["codec", "models"]  # fixtures

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "s": {"enum": ["ab", "cd"]}}, "required": ["n", "s"]}  # fmt: skip
GUIDED = dict(guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(SCHEMA), max_tokens=40)


def test_a_schema_guides_the_served_output_as_the_engine_decodes_it(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    generate_request = request("the quick brown fox", **GUIDED)
    sent = run(orchestrator, generate_request)
    final, _ = sent[-1]
    assert final["finish_reason"][0].decode() == "stop"
    jsonschema.validate(json.loads(text_of(sent)), SCHEMA)
    grammar = GrammarCompiler(codec.tokenizer, models[0].config.vocab_size).compile("json_schema", GUIDED["guided_decoding_guide"])
    params = generate_request.generation_params(16, 3, codec.eos_token_ids, (), models[0].config.vocab_size,
                                                grammar=grammar)  # fmt: skip
    assert text_of(sent) == engine_text(codec, models, "the quick brown fox", params)


@pytest.mark.parametrize("overrides, named", [
    (dict(guided_decoding_guide_type="json_schema", guided_decoding_guide='{"type": "objec"}'),
     "input 'guided_decoding_guide': json_schema guide does not compile: Unsupported type"),
    (dict(guided_decoding_guide_type="regex", guided_decoding_guide="[a-"), "input 'guided_decoding_guide': regex"),
    (dict(guided_decoding_guide_type="yaml", guided_decoding_guide="a: 1"),
     "input 'guided_decoding_guide_type' must be one of json, json_schema, regex, ebnf_grammar, structural_tag, got 'yaml'"),
    (dict(guided_decoding_guide="a+"), "input 'guided_decoding_guide' needs 'guided_decoding_guide_type'"),
    (dict(guided_decoding_guide_type="regex"), "input 'guided_decoding_guide' is required for guide type 'regex'"),
    (dict(guided_decoding_guide_type="json", guided_decoding_guide="{}"), "must be empty for guide type 'json'"),
    (dict(guided_decoding_guide_type="json", min_tokens=2), "min_tokens cannot be combined with a grammar"),
])  # fmt: skip
def test_a_bad_guide_is_refused_by_name_and_serving_goes_on(overrides, named, codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    with pytest.raises(RequestError, match=named):
        run(orchestrator, request("hello", **overrides))
    sent = run(orchestrator, request("hello", guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]{3}"))
    assert len(text_of(sent)) == 3 and text_of(sent).isdigit()
    assert stages.verifier.lm.num_active_sequences == 0


def test_json_guide_type_takes_any_json_value(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    sent = run(orchestrator, request("x", guided_decoding_guide_type="json", max_tokens=60))
    if sent[-1][0]["finish_reason"][0].decode() == "stop":
        json.loads(text_of(sent))


def test_a_step_the_table_gives_no_drafts_still_drafts_what_the_grammar_forces(codec, models):
    """k = 0 from the table at one sequence: the forced tokens (the schema's keys and punctuation) are drafted
    anyway, each accepted, and the text is the engine's at k = 0."""
    orchestrator, _ = make_orchestrator(codec, models, speculation=SpeculationLength(3, per_batch_size=((1, 0),)))
    sent = run(orchestrator, request("the quick brown fox", **GUIDED))
    final, _ = sent[-1]
    assert int(final["total_accepted_draft_tokens"][0]) == int(final["total_draft_tokens"][0]) > 0
    grammar = GrammarCompiler(codec.tokenizer, models[0].config.vocab_size).compile("json_schema", GUIDED["guided_decoding_guide"])
    params = request("the quick brown fox", **GUIDED).generation_params(16, 0, codec.eos_token_ids, (),
                                                                        models[0].config.vocab_size, grammar=grammar)  # fmt: skip
    assert text_of(sent) == engine_text(codec, models, "the quick brown fox", params)
