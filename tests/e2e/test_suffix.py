"""Suffix decoding served through ``serve.sh --speculative-config``: lossless, and it learns from past responses.

The server is the session's ``suffix_json_server`` (``conftest.py``), which ``test_trees.py`` shares with
prompts none of these."""
from __future__ import annotations

import json
import subprocess

import pytest
from client.generate import generate_grpc, generate_http
from triton_server import REPO_ROOT, models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

MAX_TOKENS = 32
PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "abababababababab",
    "The mitochondria is the powerhouse of the cell. The mitochondria is",
    "Hello, world! Hello, world! Hello,",
    "Grüße aus München! Ça va très bien,",
    "\n\n",
]


def cached_responses(server) -> float:
    """The global tree's responses; 0 before the first (the gauge is made on first use)."""
    values = [v for (name, _), v in server.metrics().items() if name == "spec_decode_suffix_cached_responses"]
    assert len(values) <= 1, values
    return values[0] if values else 0.0


def test_greedy_output_equals_the_target_and_a_repeat_is_drafted_from_the_first(suffix_json_server, reference):
    cached_before, rounds = cached_responses(suffix_json_server), []
    for _ in range(2):  # round 2 repeats round 1, as agents do
        params = {"stream": True, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
        results = [(prompt, generate_grpc(suffix_json_server.grpc_url, "ensemble", prompt, params)) for prompt in PROMPTS]
        rounds.append(reference.drafts_of_greedy_outputs(results, MAX_TOKENS))
    (_, accepted_1), (drafted_2, accepted_2) = rounds
    # the global tree holds round 1's responses: round 2 drafts them back and the target agrees (without the
    # global tree, round 2 would draft as round 1 did; other tests' responses on the server raise round 1's count)
    assert accepted_2 > 1.5 * accepted_1 and accepted_2 / drafted_2 > 0.8, rounds
    assert cached_responses(suffix_json_server) - cached_before == 2 * len(PROMPTS)


def test_http_generate_is_lossless_too(suffix_json_server, reference):
    for prompt in PROMPTS[:3]:
        result = generate_http(suffix_json_server.http_url, "ensemble", prompt,
                               {"stream": False, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})  # fmt: skip
        assert not reference.greedy_mismatch(prompt, result.text, MAX_TOKENS)


def test_serve_refuses_an_unknown_key_before_starting():
    bad = json.dumps({"method": "suffix", "bogus_key": 1})
    done = subprocess.run([str(REPO_ROOT / "scripts" / "serve.sh"), "--speculative-config", bad],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "unknown key 'bogus_key'" in done.stderr and "supported keys" in done.stderr


def test_a_bad_repository_speculative_config_fails_the_load_naming_the_key(tmp_path):
    repository = repository_copy(tmp_path, models_dir(), "draft_model", only=("speculative_decoding",))
    config = repository / "speculative_decoding" / "config.pbtxt"
    text = config.read_text().replace('key: "speculative_config" value: { string_value: "" }',
                                      'key: "speculative_config" value: { string_value: "{\\"method\\": \\"eagle\\"}" }')
    assert text != config.read_text()
    config.write_text(text)
    server = server_on_free_ports(tmp_path, repository)
    assert server.run_until_exit() != 0
    assert "speculative_config method 'eagle' is not supported yet" in server.log_tail(200)
