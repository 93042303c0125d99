"""Tool calling: the structural tag that constrains calls (lossless under speculation), the parser, the face.

Greedy decoding under each tool choice's guide at k = 3 equals k = 0 and HF ``generate``
with xgrammar's logits processor over the same grammar; a named or required choice makes
the shipped model write a call whose arguments validate. Against a scripted Triton: the
guide goes to Triton, the template sees the tools, calls come back as ``tool_calls``
(whole and streamed as vLLM streams them), and bad choices are refused by name.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from test_grammar import compiler, decode, json_text
from test_openai_server import SHIPPED_TOKENIZER, FakeBackend, client_for, events, steps

from specdec_openai.tools import ToolCallParser, message_of, tool_choice_of

__all__ = ["compiler"]  # the fixture, shared with test_grammar
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city", "days"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
MAX_TOKENS = 96  # a call is some 40 tokens of wrapper and arguments, which the shipped model writes short
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"],
                         ids=["required", "named", "auto"])  # fmt: skip
def test_greedy_calls_equal_k0_and_hf_generate_under_the_tool_guide(choice, shipped_pair, compiler):
    from xgrammar.contrib.hf import LogitsProcessor

    tools = tool_choice_of(TOOLS, choice, parallel=False)
    grammar = compiler.compile("structural_tag", tools.guide())
    tokenizer = shipped_pair.tokenizer
    prompt = "Weather in Paris for 3 days? <tool_call>\n" if choice == "auto" else "Weather in Paris? "
    plain, reason, _ = decode(shipped_pair, prompt, grammar, 0, max_tokens=MAX_TOKENS)
    speculated, reason_k, stats = decode(shipped_pair, prompt, grammar, 3, max_tokens=MAX_TOKENS)
    assert speculated == plain and reason_k == reason and stats.num_accepted_tokens > 0
    prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    with torch.inference_mode():
        reference = shipped_pair.target.generate(
            prompt_ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id, logits_processor=[LogitsProcessor(grammar.compiled)])  # fmt: skip
    assert plain == reference[0, prompt_ids.shape[1] :].tolist()
    if choice == "auto":
        return  # free text until the model writes the trigger itself, which the prompt above did not let it do
    message = message_of(ToolCallParser().push(json_text(shipped_pair, plain)))
    assert reason == "stop" and len(message["tool_calls"]) == 1, json_text(shipped_pair, plain)
    call = message["tool_calls"][0]["function"]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), schema)
    assert call["name"] == "get_time" or choice == "required"


def test_the_guide_admits_calls_of_the_tools_only(compiler):
    import xgrammar

    def accepts(guide: str, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiler.compile("structural_tag", guide).compiled)
        return matcher.accept_string(text) and matcher.is_terminated() is False and matcher.accept_token(
            compiler.tokenizer_info.stop_token_ids[0])  # fmt: skip

    auto, required = tool_choice_of(TOOLS, "auto", True).guide(), tool_choice_of(TOOLS, "required", False).guide()
    assert accepts(auto, "No call needed.") and accepts(auto, "Sure. " + CALL + " Done.")
    assert not accepts(auto, CALL.replace("get_weather", "get_wether"))
    assert not accepts(auto, CALL.replace('"days": 3', '"days": "3"'))  # arguments follow the schema
    assert not accepts(auto, CALL.replace('"city": "Paris", ', '"city":  "Paris", '))  # no free whitespace
    assert accepts(required, CALL) and not accepts(required, "No call needed.")
    assert not accepts(required, CALL + "\n" + CALL)  # parallel_tool_calls false: one call


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_the_parser_gives_the_same_message_however_the_text_is_cut(step):
    text = "Let me look. " + CALL + "\n" + CALL.replace("Paris", "Oslo")
    parser, deltas = ToolCallParser(), []
    for i in range(0, len(text), step):
        deltas += parser.push(text[i : i + step])
    deltas += parser.finish()
    message = message_of(deltas)
    assert message["content"] == "Let me look." and parser.num_calls == 2
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Oslo"]
    assert all("<tool_call>" not in d.get("content", "") for d in deltas)
    assert message_of(ToolCallParser().push("a <tool_ca") + []) == {"role": "assistant", "content": "a "}


def chat(backend, stream=False, **body):
    client = client_for(backend, tokenizer_dir=SHIPPED_TOKENIZER, chat_template=TEMPLATE)
    return client.post("/v1/chat/completions", json={"model": "speculative_decoding", "stream": stream, "messages": [
        {"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **body})  # fmt: skip


def test_calls_come_back_as_tool_calls_whole_and_streamed():
    backend = FakeBackend(steps("Sure. <tool_", "call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
                                "\"Paris\", \"days\": 3}}\n</tool_call>", finish="stop"))  # fmt: skip
    whole = chat(backend).json()["choices"][0]
    sent = backend.requests[0][1]
    assert sent["guided_decoding_guide_type"] == "structural_tag" and "get_time" in sent["guided_decoding_guide"]
    assert sent["text_input"].startswith("<tools>[{") and "get_weather" in sent["text_input"]  # the template's
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Sure."
    (call,) = whole["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    chunks = [c for c in events(chat(FakeBackend(backend.script), stream=True))[:-1] if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris", "days": 3}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_none_and_refusals():
    named = {"type": "function", "function": {"name": "get_time"}}
    backend = FakeBackend(steps('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
                                finish="stop"))  # fmt: skip
    whole = chat(backend, tool_choice=named).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert "get_weather" not in backend.requests[0][1]["guided_decoding_guide"]
    plain = FakeBackend(steps("<tool_call> as text", finish="stop"))
    assert chat(plain, tool_choice="none").json()["choices"][0]["message"]["content"] == "<tool_call> as text"
    assert "guided_decoding_guide_type" not in plain.requests[0][1]
    for body, param, message in [
        ({"tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice", "'get_wether'"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": [{"type": "function"}]}, "tools", "'tools[0]' must be"),
        ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined with 'tools'"),
    ]:  # fmt: skip
        response = chat(FakeBackend(steps("x")), **body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, body
        assert message in response.json()["error"]["message"]
