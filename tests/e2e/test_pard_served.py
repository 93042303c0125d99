"""Parallel drafting (PARD) served through ``serve.sh --speculative-config``, vLLM's JSON: lossless, one propose
call a step, and per-position acceptance reported as for a chain drafter."""
from __future__ import annotations

import json

import pytest
from client.generate import generate_grpc
from triton_server import models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

K = 4
MAX_TOKENS = 32
PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "1, 2, 3, 4, 5, 6, 7,",
]
ORCHESTRATOR = (("model", "speculative_decoding"),)


@pytest.fixture(scope="module")
def pard_server(tmp_path_factory):
    models = models_dir()
    if not (models / "tiny-draft-pard").is_dir():
        pytest.skip(f"models/tiny-draft-pard not found under {models}")
    config = {"method": "draft_model", "model": str(models / "tiny-draft-pard"), "num_speculative_tokens": K,
              "parallel_drafting": True}  # fmt: skip
    workdir = tmp_path_factory.mktemp("server_pard")
    # method and draft_model left empty: the JSON sets them (and k, the table)
    repository = repository_copy(workdir, models, "", parameters={"draft_model": "",
                                                                  "speculation_follows_acceptance": "false"})
    server = server_on_free_ports(workdir, repository, serve_args=(f"--speculative-config={json.dumps(config)}",))
    server.start()
    yield server
    server.stop()


def test_parallel_drafts_keep_the_targets_greedy_output_and_their_metrics(pard_server, reference):
    before = pard_server.metrics()
    failures, drafted, accepted = [], 0, 0
    for prompt in PROMPTS:
        result = generate_grpc(pard_server.grpc_url, "ensemble", prompt,
                               {"stream": True, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})  # fmt: skip
        drafted += result.total_draft_tokens
        accepted += result.total_accepted_draft_tokens
        failure = reference.greedy_mismatch(prompt, result.text, MAX_TOKENS)
        if failure:
            failures.append(failure)
    assert not failures, "\n".join(failures)
    assert 0 < accepted < drafted
    after = pard_server.metrics()
    per_position = [after.get(("spec_decode_num_accepted_tokens_per_pos", ORCHESTRATOR + (("position", str(i)),)),
                              0.0) - before.get(("spec_decode_num_accepted_tokens_per_pos",
                                                 ORCHESTRATOR + (("position", str(i)),)), 0.0)
                    for i in range(K)]  # fmt: skip
    assert per_position[0] > 0 and per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == accepted

    sampled = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7, "exclude_input_in_output": True}
    texts = {generate_grpc(pard_server.grpc_url, "ensemble", PROMPTS[1], {**sampled, "stream": s}).text
             for s in (False, True)}  # fmt: skip
    assert len(texts) == 1  # q per position reached the sampler: the same seed, the same draws
    # the draft drafted in parallel (not as a chain over the same checkpoint)
    assert "parallel_drafting: " in pard_server.log_path.read_text() and "mask token 188 (pard_token)" in \
        pard_server.log_path.read_text()
