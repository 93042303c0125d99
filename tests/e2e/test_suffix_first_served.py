"""Suffix decoding in front of the shipped EAGLE-3 head, served: exact, and both sources draft.

The server is configured as a vLLM / Arctic Inference user would: ``--speculative-config``
with ``method: eagle3`` and ``enable_suffix_decoding: true``, the head served composing
(draft_proposer in its own process), so a step that suffix decoding drafts for makes no
call to it and the next one sends it every token and hidden state it missed; or beside the
target (``run_with_target``), where such a step sends its drafts in the verify request and
the head reads the rows it missed where the target keeps them.
"""
from __future__ import annotations

import json

import pytest
from client.generate import generate_grpc, generate_http
from triton_server import models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

SPECULATIVE_CONFIG = {"method": "eagle3", "num_speculative_tokens": 6, "enable_suffix_decoding": True}
MAX_TOKENS = 32
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "import os\nimport sys\nimport os\nimport",
    "Once upon a time",
]


@pytest.fixture(scope="module", params=["composing", "beside"])
def server(tmp_path_factory, request):
    """The head composing, or beside the target (run_with_target: a step is one call to target_verifier)."""
    models = models_dir()
    if not (models / "tiny-eagle3").is_dir():
        pytest.skip(f"no tiny-eagle3 under {models}")
    workdir = tmp_path_factory.mktemp("server_suffix_first")
    parameters = {"draft_model": str(models / "tiny-eagle3"), "model_num_speculative_tokens": "3",
                  "run_with_target": "true" if request.param == "beside" else "false"}  # fmt: skip
    repository = repository_copy(workdir, models, "", parameters=parameters)
    server = server_on_free_ports(workdir, repository, serve_args=(f"--speculative-config={json.dumps(SPECULATIVE_CONFIG)}",))
    server.start()
    yield server
    server.stop()


def by_source(server, counter: str = "proposals") -> dict[str, float]:
    return {dict(labels)["source"]: value for (name, labels), value in server.metrics().items()
            if name == f"spec_decode_suffix_first_{counter}"}  # fmt: skip


def test_greedy_output_equals_the_targets_with_drafts_from_both_sources(server, reference):
    failures, accepted = [], 0
    for i, prompt in enumerate(PROMPTS):
        params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
        result = (generate_grpc(server.grpc_url, "ensemble", prompt, {"stream": True, **params}) if i % 2 else
                  generate_http(server.http_url, "ensemble", prompt, {"stream": False, **params}))  # fmt: skip
        failure = reference.greedy_mismatch(prompt, result.text, MAX_TOKENS)
        if failure:
            failures.append(failure)
        accepted += result.total_accepted_draft_tokens
    assert not failures, "\n".join(failures)
    assert accepted > 0
    steps = by_source(server)
    assert steps.get("suffix", 0) > 0 and steps.get("model", 0) > 0, steps
    accepted = by_source(server, "accepted_tokens")
    assert accepted.get("suffix", 0) > 0 and accepted.get("model", 0) > 0, accepted
    log = server.log_path.read_text()
    assert "suffix decoding first, in this process; then" in log


def test_sampled_requests_are_served_with_drafts(server):
    """Sampled steps mix suffix decoding's one-hot q and the head's q in one rejection sampler."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "stream": False,
              "exclude_input_in_output": True}  # fmt: skip
    results = [generate_http(server.http_url, "ensemble", prompt, {**params, "seed": 11}) for prompt in PROMPTS[1:3]]
    assert all(r.text for r in results) and sum(r.total_draft_tokens for r in results) > 0
