"""Through a real server: bad requests get an error naming the input, and the server keeps serving."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from client.generate import GenerateError, generate_grpc, generate_http, grpc_stream
from triton_server import server_on_free_ports, models_dir, repository_copy

pytestmark = pytest.mark.server

BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"max_tokens": 10**6}, "exceeds max_model_len"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"num_speculative_tokens": -1}, r"'num_speculative_tokens' must be in \[0, 8\]"),
    ({"num_speculative_tokens": 9}, r"'num_speculative_tokens' must be in \[0, 8\]"),
    ({"min_tokens": 99, "max_tokens": 8}, r"min_tokens must be in \[0, max_tokens=8\]"),
    ({"end_id": -2}, r"'end_id' must be a token id in \[0, \d+\), got -2"),
    ({"end_id": 10**6}, r"'end_id' must be a token id in \[0, \d+\), got 1000000"),
]


def assert_serving(server):
    result = generate_grpc(server.grpc_url, "ensemble", "Hello", {"max_tokens": 4})
    assert result.num_output_tokens == 4


@pytest.mark.parametrize("params, message", BAD_PARAMS, ids=[str(p) for p, _ in BAD_PARAMS])
def test_bad_parameters_are_named(server, params, message):
    for call in (generate_grpc, generate_http):
        url = server.grpc_url if call is generate_grpc else server.http_url
        with pytest.raises(GenerateError, match=message):
            call(url, "ensemble", "Hello", params)


@pytest.mark.parametrize("prompt", ["", b"\xff\xfe bad utf-8"])
def test_bad_text_input_is_named(server, prompt):
    with pytest.raises(GenerateError, match="text_input"):
        generate_grpc(server.grpc_url, "ensemble", prompt, {"max_tokens": 4})


def post_generate(server, model: str, body: dict) -> tuple[int, str]:
    """(HTTP status, error text or body) of one ``/generate`` request sent as is, bypassing the client's checks."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode()).get("error", "")


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_a_request_without_text_input_is_named(server, model):
    """Triton counts inputs, not names: max_tokens alone passes its check, and the model must answer."""
    status, error = post_generate(server, model, {"max_tokens": 4})
    assert status == 400 and "input 'text_input' is required" in error
    max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([4], np.int32))
    with pytest.raises(GenerateError, match="input 'text_input' is required"):
        grpc_stream(server.grpc_url, model, [max_tokens])


def test_a_misspelt_http_key_is_named_not_ignored(server):
    """/generate passes JSON keys that name no input on as request parameters."""
    status, error = post_generate(server, "ensemble", {"text_input": "Hello", "max_token": 4})
    assert status == 400 and "unknown request parameter 'max_token' (did you mean 'max_tokens'?)" in error
    assert_serving(server)


def test_prompt_longer_than_max_model_len(server, reference):
    prompt = "a b " * reference.max_model_len
    with pytest.raises(GenerateError, match=r"prompt \(\d+ tokens\) \+ max_tokens \(4\) exceeds max_model_len"):
        generate_http(server.http_url, "ensemble", prompt, {"max_tokens": 4})


@pytest.mark.parametrize(
    "name, array, datatype, message",
    [
        ("max_tokens", np.array([4.0], np.float32), "FP32", "input 'max_tokens' data-type is 'FP32', but .* 'INT32'"),
        ("max_tokens", np.array([4, 4], np.int32), "INT32", "unexpected shape for input 'max_tokens'"),
        ("temperature", np.array([[0.5]], np.float32), "FP32", "unexpected shape for input 'temperature'"),
    ],
)
def test_wrong_dtype_or_shape_is_named(server, name, array, datatype, message):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=np.object_))
    bad = grpcclient.InferInput(name, list(array.shape), datatype)
    bad.set_data_from_numpy(array)
    with pytest.raises(GenerateError, match=message):
        grpc_stream(server.grpc_url, "ensemble", [text, bad])


def test_server_keeps_serving_and_holds_no_sequences(server):
    for params, _ in BAD_PARAMS:
        with pytest.raises(GenerateError):
            generate_grpc(server.grpc_url, "ensemble", "Hello", params)
    assert_serving(server)
    active = {k: v for k, v in server.metrics().items() if k[0] == "spec_decode_num_active_sequences"}
    assert active and not any(active.values()), active


def test_a_bad_parameter_fails_the_load_naming_key_and_choices(tmp_path):
    repository = repository_copy(tmp_path, models_dir(), "draft_model", only=("rejection_sampler",))
    config = repository / "rejection_sampler" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "probabilistic"', 'string_value: "greedy"'))
    server = server_on_free_ports(tmp_path, repository)
    assert server.run_until_exit() != 0
    assert (
        "rejection_sampler: parameter 'rejection_sample_method' must be one of "
        "('strict', 'probabilistic', 'synthetic'), got 'greedy'" in server.log_tail(200)
    )
