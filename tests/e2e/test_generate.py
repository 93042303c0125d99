"""Through a real server: greedy output equals the target's own greedy decoding, and streaming is exact."""
from __future__ import annotations

import pytest
from client.generate import generate_grpc, generate_http

pytestmark = pytest.mark.server

MAX_TOKENS = 32
PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import numpy as np\n\nx = np.arange(10)\nprint(",
    "for i in range(10):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    '{"id": 1, "name": "alpha", "tags": [',
    "1, 2, 3, 4, 5, 6, 7,",
    "abababababababab",
    "The mitochondria is the powerhouse of the cell. The mitochondria is",
    "To be, or not to be, that is the question:",
    "# Compute the mean\ndef mean(xs):\n    return",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "Hello, world! Hello, world! Hello,",
    "<html><body><p>",
    "x = [i * i for i in range(",
    "Grüße aus München! Ça va très bien,",
    "東京は日本の首都です。",
    "Привет, мир!",
    "emoji: 🚀🔥✨ and",
    "\n\n",
]
NON_ASCII = [p for p in PROMPTS if not p.isascii()]


def generate(server, protocol: str, prompt: str, **params):
    if protocol == "grpc":
        return generate_grpc(server.grpc_url, "ensemble", prompt, {"stream": True, **params})
    return generate_http(server.http_url, "ensemble", prompt, {"stream": False, **params})


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("server_name", ["server", "ngram_server", "table_server"])
def test_greedy_output_equals_the_targets_greedy_decoding(request, reference, server_name, protocol):
    server = request.getfixturevalue(server_name)
    failures, drafted = [], 0
    for prompt in PROMPTS:
        result = generate(server, protocol, prompt, max_tokens=MAX_TOKENS, exclude_input_in_output=True)
        drafted += result.total_draft_tokens
        failure = reference.greedy_mismatch(prompt, result.text, MAX_TOKENS)
        if failure:
            failures.append(failure)
    assert not failures, "\n".join(failures)
    assert drafted > 0  # speculation actually ran


@pytest.mark.parametrize("k", [0, 1])
def test_per_request_speculation_depth_keeps_the_output(server, reference, k):
    for prompt in PROMPTS[:4]:
        result = generate(server, "grpc", prompt, max_tokens=MAX_TOKENS, num_speculative_tokens=k)
        assert reference.greedy_mismatch(prompt, result.text, MAX_TOKENS) is None
        assert result.total_draft_tokens <= k * MAX_TOKENS and (k or result.total_draft_tokens == 0)


# seeded, on the suffix server: its global tree drafts each repeat from the earlier responses,
# and the text must not change with what was drafted (draws keyed by output position)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}])
def test_streamed_text_equals_non_streamed_text(server, sampling):
    for prompt in NON_ASCII + PROMPTS[:3]:
        params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, **sampling}
        whole = generate_grpc(server.grpc_url, "ensemble", prompt, {"stream": False, **params})
        streamed = generate_grpc(server.grpc_url, "ensemble", prompt, {"stream": True, **params})
        http_whole = generate_http(server.http_url, "ensemble", prompt, {"stream": False, **params})
        http_streamed = generate_http(server.http_url, "ensemble", prompt, {"stream": True, **params})
        assert len(whole.chunks) == len(http_whole.chunks) == 1
        assert streamed.text == whole.text == http_whole.text == http_streamed.text, prompt
        assert streamed.num_output_tokens == whole.num_output_tokens
        assert not any(chunk.endswith("\ufffd") for chunk in streamed.chunks[:-1])  # partial characters held back


def test_output_includes_the_prompt_unless_excluded(server, reference):
    prompt = PROMPTS[0]
    included = generate(server, "http", prompt, max_tokens=8)
    excluded = generate(server, "http", prompt, max_tokens=8, exclude_input_in_output=True)
    assert included.text == prompt + excluded.text
    assert (included.finish_reason, included.num_output_tokens) == ("length", 8)
    assert included.num_input_tokens == len(reference.codec.encode_prompt(prompt))


def test_end_id_and_min_tokens_match_hugging_face(server, reference):
    prompt = PROMPTS[1]
    _, ref_ids = reference.greedy_ids(prompt, MAX_TOKENS)
    end_id = ref_ids[3]
    stop_at = ref_ids.index(end_id)
    result = generate(server, "http", prompt, max_tokens=MAX_TOKENS, end_id=end_id, exclude_input_in_output=True)
    assert result.finish_reason == "stop" and result.num_output_tokens == stop_at + 1
    assert result.text == reference.codec.decode(ref_ids[: stop_at + 1])
    # min_tokens bans end_id until that many tokens exist; Hugging Face's min_new_tokens does the same.
    min_tokens = stop_at + 2
    _, expected = reference.greedy_ids(prompt, MAX_TOKENS, eos_token_ids=[end_id], min_new_tokens=min_tokens)
    result = generate(server, "grpc", prompt, max_tokens=MAX_TOKENS, end_id=end_id, min_tokens=min_tokens,
                      exclude_input_in_output=True)  # fmt: skip
    assert result.text == reference.codec.decode(expected)
    assert result.num_output_tokens == len(expected) >= min_tokens


def test_stop_words_end_the_output_after_the_stop_sequence(server, reference):
    prompt = PROMPTS[0]
    _, ref_ids = reference.greedy_ids(prompt, MAX_TOKENS)
    codec = reference.codec
    for start in range(2, len(ref_ids) - 2):
        word = codec.decode(ref_ids[start : start + 2])
        if codec.encode_stop_words([word]) == [ref_ids[start : start + 2]]:
            break
    else:
        pytest.skip("no two-token span of the output tokenizes the same on its own")
    result = generate(server, "grpc", prompt, max_tokens=MAX_TOKENS, stop_words=[word], exclude_input_in_output=True)
    assert result.finish_reason == "stop"
    assert result.text.endswith(word) and codec.decode(ref_ids).startswith(result.text)


def test_min_p_is_served_and_seeded_output_repeats(server):
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "temperature": 1.0, "min_p": 0.2, "seed": 5}
    first = generate(server, "grpc", PROMPTS[0], **params)
    again = generate(server, "http", PROMPTS[0], **params)
    plain = generate(server, "grpc", PROMPTS[0], num_speculative_tokens=0, **params)
    assert first.text == again.text == plain.text and first.num_output_tokens == MAX_TOKENS
