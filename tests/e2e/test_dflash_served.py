"""Through a real server: the shipped DFlash drafter set by vLLM's ``speculative_config`` keeps the output exact.

One server: ``{"method": "dflash", "model": ".../tiny-dflash", "num_speculative_tokens": K}`` through
``serve.sh --speculative-config`` (as vLLM takes it), the drafter in its own model (draft_proposer),
so the target's hidden states travel target_verifier -> orchestrator -> draft_proposer on every
step. The placement beside the target (``run_with_target``) runs the same proposer through
``DraftBesideTarget`` (``tests/test_draft_beside_target.py``).
"""
from __future__ import annotations

import json

import pytest
from client.generate import generate_grpc
from triton_server import models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

K = 6  # under the shipped drafter's block_size - 1 = 8
MAX_TOKENS = 32
ORCHESTRATOR = (("model", "speculative_decoding"),)
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\nimport sys\n\n\ndef main():\n",
    "Once upon a time",
    "1, 2, 3, 4, 5, 6, 7,",
]


@pytest.fixture(scope="module")
def dflash_server(tmp_path_factory):
    models = models_dir()
    if not (models / "tiny-dflash").is_dir():
        pytest.skip(f"tiny-dflash not found under {models}")
    workdir = tmp_path_factory.mktemp("server_dflash")
    # method and draft_model left empty: the JSON sets them (a pbtxt key set elsewhere would have to agree)
    parameters = {"draft_model": "", "speculation_follows_acceptance": "false"}
    repository = repository_copy(workdir, models, "", parameters=parameters)
    config = {"method": "dflash", "model": str(models / "tiny-dflash"), "num_speculative_tokens": K}
    server = server_on_free_ports(workdir, repository, serve_args=(f"--speculative-config={json.dumps(config)}",))
    server.start()
    yield server
    server.stop()


def test_dflash_greedy_output_equals_the_targets_and_per_position_acceptance_adds_up(dflash_server, reference):
    before = dflash_server.metrics()
    failures, results = [], []
    for prompt in PROMPTS:
        for stream in (True, False):
            result = generate_grpc(dflash_server.grpc_url, "ensemble", prompt,
                                   {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "stream": stream})  # fmt: skip
            results.append(result)
            failure = reference.greedy_mismatch(prompt, result.text, MAX_TOKENS)
            if failure:
                failures.append(failure)
    assert not failures, "\n".join(failures)
    after = dflash_server.metrics()
    drafted = sum(r.total_draft_tokens for r in results)
    accepted = sum(r.total_accepted_draft_tokens for r in results)
    assert 0 < accepted < drafted
    per_position = [after[("spec_decode_num_accepted_tokens_per_pos", ORCHESTRATOR + (("position", str(i)),))]
                    - before.get(("spec_decode_num_accepted_tokens_per_pos", ORCHESTRATOR + (("position", str(i)),)), 0)
                    for i in range(K)]  # fmt: skip
    assert per_position == sorted(per_position, reverse=True) and per_position[1] > 0  # a block: more than one kept
    assert sum(per_position) == accepted
    assert after[("spec_decode_num_active_sequences", (("model", "draft_proposer"),))] == 0


def test_dflash_seeded_sampling_equals_itself_streamed_or_not(dflash_server):
    """Sampled drafts are drawn from each block position's q with the step's seed: the same text either way."""
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "temperature": 0.9, "top_p": 0.95,
              "seed": 1234}  # fmt: skip
    for prompt in PROMPTS[:2]:
        streamed = generate_grpc(dflash_server.grpc_url, "ensemble", prompt, {**params, "stream": True})
        whole = generate_grpc(dflash_server.grpc_url, "ensemble", prompt, {**params, "stream": False})
        assert streamed.text == whole.text and streamed.total_draft_tokens > 0, prompt
