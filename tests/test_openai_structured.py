"""Structured output on the OpenAI face: response_format and vLLM's extras become the server's guide inputs."""
from __future__ import annotations

import json

import pytest

from specdec_openai.protocol import RequestError
from test_openai_server import SHIPPED_TOKENIZER, TEMPLATE, FakeBackend, steps
from test_openai_server import client_for as plain_client

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def client_for(backend):
    return plain_client(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)


CHAT = {"model": "ensemble", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields, guide_type, guide", [
    ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}, "json_schema",
     json.dumps(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf_grammar", 'root ::= "a"'),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"guided_grammar": 'root ::= "b"'}, "ebnf_grammar", 'root ::= "b"'),
    ({"guided_choice": ["yes", "no"]}, "ebnf_grammar", 'root ::= "yes" | "no"'),
])  # fmt: skip
def test_each_structured_output_field_sends_its_guide(fields, guide_type, guide):
    backend = FakeBackend(steps('{"a": 1}', finish="stop"))
    response = client_for(backend).post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 200, response.text
    inputs = backend.requests[0][1]
    assert inputs["guided_decoding_guide_type"] == guide_type and inputs["guided_decoding_guide"] == guide
    completion = client_for(backend).post("/v1/completions", json={"model": "ensemble", "prompt": "a", **fields})
    assert completion.status_code == 200 and backend.requests[1][1]["guided_decoding_guide"] == guide


def test_text_response_format_sends_no_guide():
    backend = FakeBackend(steps("x"))
    client_for(backend).post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert "guided_decoding_guide_type" not in backend.requests[0][1]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])  # fmt: skip
def test_a_malformed_guide_is_a_400_naming_its_field(fields, param):
    backend = FakeBackend(steps("x"))
    response = client_for(backend).post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert not backend.requests


def test_a_guide_the_server_refuses_is_a_400_naming_the_field_it_came_from():
    refusal = RequestError("ensemble: input 'guided_decoding_guide': json_schema guide does not compile: "
                           'Unsupported type "objec"')  # fmt: skip
    client = client_for(FakeBackend(refusal))
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objec"}}}}
    response = client.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format" and "objec" in error["message"]
    assert client_for(FakeBackend(steps("x"))).post("/v1/chat/completions", json=CHAT).status_code == 200
