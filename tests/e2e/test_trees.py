"""Draft trees served: suffix decoding's speculation tree, EAGLE-3's (with the target) and Medusa's (in its own
model) static trees, lossless end to end."""
from __future__ import annotations

import json

import pytest
from client.generate import generate_grpc
from triton_server import models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

MAX_TOKENS = 32
PROMPTS = [  # none of test_suffix.py's, whose server the suffix tree's tests share
    "Once upon a midnight dreary,",
    "def gcd(a, b):\n    while b:\n        a, b =",
    "cdcdcdcdcdcdcdcd",
    "The heart pumps blood through the body. The heart pumps",
    "Hi there! Hi there! Hi",
    "1, 2, 3, 4, 5, 6, 7,",
]
TREE = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]"
# suffix decoding's tree set by vLLM-style JSON on serve.sh's command line (conftest.py's suffix_json_server),
# Medusa's in draft_proposer's speculative_config parameter, EAGLE-3's in config.pbtxt's own keys (the shipped k
# is 8), drafted beside the target
HEAD_PARAMETERS = {"speculative_token_tree": TREE, "speculation_follows_acceptance": "false"}
HEADS = {"eagle3": "tiny-eagle3", "medusa": "tiny-medusa"}  # the tree's depth 4: Medusa's four heads


@pytest.fixture(scope="module", params=["suffix", "eagle3", "medusa"])
def tree_server(request, tmp_path_factory):
    if request.param == "suffix":  # the session's, which test_suffix.py shares (conftest.py)
        yield request.getfixturevalue("suffix_json_server")
        return
    models = models_dir()
    if not all((models / head).is_dir() for head in HEADS.values()):
        pytest.skip(f"shipped models not found under {models}")
    workdir = tmp_path_factory.mktemp(f"server_tree_{request.param}")
    if request.param == "medusa":  # vLLM's JSON in draft_proposer's speculative_config parameter
        config = {"method": "medusa", "model": str(models / HEADS["medusa"]), "num_speculative_tokens": 8,
                  "speculative_token_tree": TREE}  # fmt: skip
        parameters = {"speculative_config": json.dumps(config).replace('"', '\\"'), "draft_model": "",
                      "speculation_follows_acceptance": "false"}  # fmt: skip (draft_model: the JSON's, set once)
        repository, serve_args = repository_copy(workdir, models, "medusa", parameters=parameters), ()
    else:
        parameters = {**HEAD_PARAMETERS, "draft_model": str(models / HEADS[request.param]), "run_with_target": "true"}
        repository, serve_args = repository_copy(workdir, models, request.param, parameters=parameters), ()
    server = server_on_free_ports(workdir, repository, serve_args=serve_args)
    server.start()
    yield server
    server.stop()


def _generate(server, prompt, **params):
    return generate_grpc(server.grpc_url, "ensemble", prompt,
                         {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, **params})  # fmt: skip


def test_greedy_output_with_trees_equals_the_targets(tree_server, reference):
    # suffix decoding drafts the second round from the first's responses
    results = [(prompt, _generate(tree_server, prompt, stream=True)) for _ in range(2) for prompt in PROMPTS]
    drafted, accepted = reference.drafts_of_greedy_outputs(results, MAX_TOKENS)
    assert accepted > 0 and drafted > accepted  # trees ran, and their other branches were drafted too


@pytest.mark.parametrize("sampling", [{"temperature": 0.9, "top_p": 0.95, "seed": 1234}])
def test_seeded_sampling_with_trees_equals_plain_decoding(tree_server, sampling):
    """A tree's verdict draws the target's own token from the numbers of its output position: k = 0's text."""
    for prompt in PROMPTS[:4]:
        plain = _generate(tree_server, prompt, stream=False, num_speculative_tokens=0, **sampling)
        streamed = _generate(tree_server, prompt, stream=True, **sampling)
        whole = _generate(tree_server, prompt, stream=False, **sampling)
        assert streamed.text == whole.text == plain.text, prompt
        assert plain.total_draft_tokens == 0
