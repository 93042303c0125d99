"""Through a real server with ``run_in_orchestrator``: the target loaded in speculative_decoding's process.

The output must be what the target alone produces (greedy: HF ``generate``; seeded sampling:
the text of a server whose target is a composing model, since draws are keyed by output
position and do not depend on what was drafted), and target_verifier, which then holds
nothing, answers a request sent to it with an error that says why.
"""
from __future__ import annotations

import numpy as np
import pytest
from client.generate import generate_grpc, generate_http
from test_components import infer
from test_generate import MAX_TOKENS, NON_ASCII, PROMPTS
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.server


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_greedy_output_equals_the_targets_greedy_decoding(target_here_server, reference, protocol):
    send = generate_grpc if protocol == "grpc" else generate_http
    failures, drafted = [], 0
    for prompt in PROMPTS:
        result = send(target_here_server.grpc_url if protocol == "grpc" else target_here_server.http_url, "ensemble",
                      prompt, {"stream": protocol == "grpc", "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})
        drafted += result.total_draft_tokens
        failures.append(reference.greedy_mismatch(prompt, result.text, MAX_TOKENS))
    assert not any(failures), "\n".join(f for f in failures if f)
    assert drafted > 0  # speculation actually ran


def test_seeded_sampling_gives_the_text_of_a_composing_target(target_here_server, ngram_server):
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "temperature": 0.9, "top_p": 0.95,
              "seed": 1234}  # fmt: skip
    for prompt in NON_ASCII + PROMPTS[:4]:
        here = generate_grpc(target_here_server.grpc_url, "ensemble", prompt, {"stream": True, **params})
        whole = generate_grpc(target_here_server.grpc_url, "ensemble", prompt, {"stream": False, **params})
        composing = generate_grpc(ngram_server.grpc_url, "ensemble", prompt, {"stream": False, **params})
        assert here.text == whole.text == composing.text, prompt


def test_target_verifier_says_it_holds_nothing_and_the_server_keeps_serving(target_here_server, reference):
    with pytest.raises(InferenceServerException, match="run_in_orchestrator"):
        infer(target_here_server, "target_verifier", batched=True, describe=np.array([True]))
    prompt = PROMPTS[0]
    text = generate_http(target_here_server.http_url, "ensemble", prompt,
                         {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}).text  # fmt: skip
    assert reference.greedy_mismatch(prompt, text, MAX_TOKENS) is None
    log = target_here_server.log_path.read_text()
    assert "target_verifier runs in this process (run_in_orchestrator)" in log
