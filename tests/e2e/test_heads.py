"""Through a real server: draft heads that read the target's hidden states keep the output exact.

Each server serves a copy of the repository whose draft_proposer loads a head built here
with random weights for the shipped target (EAGLE-3 in the speculators format, an MLP
speculator in its published layout), or a shipped head (``tiny-eagle3``,
``tiny-mlp-speculator``, ``tiny-medusa``), so the target's hidden states travel target_verifier ->
orchestrator -> draft_proposer on every step. The shipped EAGLE-3 head is served in both
placements: its own model, and with ``run_with_target`` on draft_proposer (the head runs
in target_verifier's process, a step is one call there, and the hidden states never
leave the target's process). A trained head is only accepted if they arrive whole.
"""
from __future__ import annotations

import pytest
import torch
from client.generate import generate_grpc, generate_http
from triton_server import models_dir, repository_copy, server_on_free_ports

from specdec.fast.checkpoint import read_config
from specdec.heads.eagle3 import Eagle3Head, eagle3_config_for
from specdec.heads.formats import save_eagle3
from specdec.heads.mlp_speculator import MLPSpeculator, save_mlp_speculator

pytestmark = pytest.mark.server

MAX_TOKENS = 24
PROMPTS = ["Once upon a time", "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "1, 2, 3, 4, 5,"]
N_PREDICT = 2


SHIPPED_HEADS = {"eagle3": "tiny-eagle3", "mlp_speculator": "tiny-mlp-speculator", "medusa": "tiny-medusa"}


def _serve(tmp_path_factory, method: str, write_head, parameters: dict[str, str] | None = None):
    """A server whose draft_proposer loads the head ``write_head`` writes (None: the shipped head of ``method``)."""
    models = models_dir()
    if not (models / "tiny-target").is_dir():
        pytest.skip(f"model pair not found under {models}")
    workdir = tmp_path_factory.mktemp(f"server_{method}")
    head = models / SHIPPED_HEADS[method]
    if write_head is not None:
        torch.manual_seed(0)
        head = workdir / "head"
        write_head(read_config(models / "tiny-target"), head)
    elif not head.is_dir():
        pytest.skip(f"no {head.name} under {models}")
    # every step drafts the table's k, so that a seed gives the same text on each server: a head's drafts shape the draws
    fixed_k = {"speculation_follows_acceptance": "false"}
    repository = repository_copy(workdir, models, method, parameters={"draft_model": str(head), **fixed_k,
                                                                      **(parameters or {})})  # fmt: skip
    server = server_on_free_ports(workdir, repository)
    server.start()
    return server


def _eagle3(target, out):
    head = Eagle3Head(eagle3_config_for(target, draft_vocab_size=target.vocab_size // 2))
    with torch.no_grad():
        head.d2t.copy_(torch.arange(head.config.draft_vocab_size))  # the even target ids
        head.t2d.zero_()
        head.t2d[::2] = True
    save_eagle3(head, out, verifier="tiny-target")


def _mlp_speculator(target, out):
    config = dict(n_predict=N_PREDICT, emb_dim=target.hidden_size, inner_dim=64, vocab_size=target.vocab_size,
                  tie_weights=False, scale_input=True)  # fmt: skip
    save_mlp_speculator(MLPSpeculator(config), out)


@pytest.fixture(scope="module")
def eagle3_server(tmp_path_factory):
    server = _serve(tmp_path_factory, "eagle3", _eagle3)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shipped_eagle3_server(tmp_path_factory):
    """The shipped head in its own model, draft_proposer."""
    server = _serve(tmp_path_factory, "eagle3", None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shipped_eagle3_beside_server(tmp_path_factory):
    """The shipped head in target_verifier's process (draft_proposer's run_with_target): one call a step."""
    server = _serve(tmp_path_factory, "eagle3", None, {"run_with_target": "true"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shipped_mlp_server(tmp_path_factory):
    """k = 3, its n_predict (the shipped orchestrator drafts up to 8)."""
    server = _serve(tmp_path_factory, "mlp_speculator", None,
                    {"num_speculative_tokens": "3", "num_speculative_tokens_per_batch_size": "1:3,5:0"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mlp_server(tmp_path_factory):
    """k = n_predict: a server whose steps may ask more fails its load (tests/test_drafters.py)."""
    server = _serve(tmp_path_factory, "mlp_speculator", _mlp_speculator,
                    {"num_speculative_tokens": str(N_PREDICT), "num_speculative_tokens_per_batch_size": ""})
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_eagle3_greedy_output_equals_the_targets(eagle3_server, reference, protocol):
    drafted = 0
    for prompt in PROMPTS:
        params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
        if protocol == "grpc":
            result = generate_grpc(eagle3_server.grpc_url, "ensemble", prompt, {"stream": True, **params})
        else:
            result = generate_http(eagle3_server.http_url, "ensemble", prompt, {"stream": False, **params})
        assert reference.greedy_mismatch(prompt, result.text, MAX_TOKENS) is None
        drafted += result.total_draft_tokens
    assert drafted > 0  # the head drafted from the hidden states it was sent


def _accepted_and_exact(server, reference, stream: bool) -> int:
    """Greedy text equal to the target's for every prompt; the drafts accepted in all."""
    accepted = 0
    for prompt in PROMPTS:
        params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "stream": stream}
        generate = generate_grpc if stream else generate_http
        result = generate(server.grpc_url if stream else server.http_url, "ensemble", prompt, params)
        assert reference.greedy_mismatch(prompt, result.text, MAX_TOKENS) is None
        accepted += result.total_accepted_draft_tokens
    return accepted


def test_the_shipped_eagle3_head_is_accepted_and_exact(shipped_eagle3_server, reference):
    # a trained head: its drafts are accepted through the whole served path
    assert _accepted_and_exact(shipped_eagle3_server, reference, stream=False) > 0


def test_sampled_requests_with_the_head_in_its_own_model_hold_q_in_the_sampler(shipped_eagle3_server):
    """The head's q goes from draft_proposer's process to rejection_sampler, which judges the step."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 7, "stream": False,
              "exclude_input_in_output": True}
    first = generate_http(shipped_eagle3_server.http_url, "ensemble", PROMPTS[1], params)
    again = generate_http(shipped_eagle3_server.http_url, "ensemble", PROMPTS[1], {**params, "stream": True})
    assert first.text == again.text and first.total_accepted_draft_tokens > 0


def test_the_shipped_eagle3_head_beside_the_target_is_accepted_and_exact(shipped_eagle3_beside_server, reference):
    assert _accepted_and_exact(shipped_eagle3_beside_server, reference, stream=True) > 0
    log = shipped_eagle3_beside_server.log_path.read_text()
    assert "run_with_target: draft_proposer's eagle3" in log and "runs here" in log


def test_sampled_text_is_the_same_in_both_placements_of_the_head(shipped_eagle3_beside_server, shipped_eagle3_server):
    """Seed for seed: q held in the sampler from target_verifier's process or from draft_proposer's, p judged
    there: rejection_sampler owns the rule and its random numbers, wherever the head runs."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 11, "stream": False,
              "exclude_input_in_output": True}  # fmt: skip
    for prompt in PROMPTS:
        beside = generate_http(shipped_eagle3_beside_server.http_url, "ensemble", prompt, params)
        own = generate_http(shipped_eagle3_server.http_url, "ensemble", prompt, params)
        assert beside.text == own.text and beside.total_accepted_draft_tokens == own.total_accepted_draft_tokens


def test_eagle3_sampled_requests_are_served(eagle3_server):
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 7, "stream": False}
    first = generate_http(eagle3_server.http_url, "ensemble", PROMPTS[0], params)
    again = generate_http(eagle3_server.http_url, "ensemble", PROMPTS[0], params)
    assert first.text == again.text and first.total_draft_tokens > 0


def test_mlp_speculator_serves_k_up_to_n_predict_and_refuses_more_by_name(mlp_server, reference):
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "stream": False}
    result = generate_http(mlp_server.http_url, "ensemble", PROMPTS[1], params)  # the configured k: n_predict
    assert reference.greedy_mismatch(PROMPTS[1], result.text, MAX_TOKENS) is None and result.total_draft_tokens > 0
    with pytest.raises(Exception, match=rf"'num_speculative_tokens' must be in \[0, {N_PREDICT}\]"):
        generate_http(mlp_server.http_url, "ensemble", PROMPTS[1], {**params, "num_speculative_tokens": N_PREDICT + 1})
    again = generate_http(mlp_server.http_url, "ensemble", PROMPTS[2], {**params, "num_speculative_tokens": 1})
    assert reference.greedy_mismatch(PROMPTS[2], again.text, MAX_TOKENS) is None


def test_the_shipped_mlp_speculator_is_accepted_and_exact(shipped_mlp_server, reference):
    assert _accepted_and_exact(shipped_mlp_server, reference, stream=True) > 0  # trained stages accepted


@pytest.fixture(scope="module")
def shipped_medusa_server(tmp_path_factory):
    """k = 4, its num_heads, set as vLLM's speculative_config sets it."""
    config = '{"method": "medusa", "model": "%s", "num_speculative_tokens": 4}' % (models_dir() / "tiny-medusa")
    server = _serve(tmp_path_factory, "medusa", None, {"speculative_config": config.replace('"', '\\"')})
    yield server
    server.stop()


def test_the_shipped_medusa_heads_served_by_speculative_config_are_accepted_and_exact(shipped_medusa_server,
                                                                                       reference):  # fmt: skip
    assert _accepted_and_exact(shipped_medusa_server, reference, stream=True) > 0
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 7, "stream": False,
              "exclude_input_in_output": True}  # fmt: skip
    first = generate_http(shipped_medusa_server.http_url, "ensemble", PROMPTS[1], params)  # sampled: q from each head
    again = generate_http(shipped_medusa_server.http_url, "ensemble", PROMPTS[1], {**params, "stream": True})
    assert first.text == again.text and first.total_draft_tokens > 0
