"""Through a real server: drafters set by vLLM's ``speculative_config`` alone keep the output exact.

One server per drafter, one after another (a module-scoped fixture over ``SERVED``), each
configured through ``serve.sh --speculative-config`` as vLLM takes it:

* ``dflash``: the shipped DFlash drafter (``models/tiny-dflash``), a block of drafts from one
  pass, in its own model (draft_proposer): the target's hidden states travel
  target_verifier -> orchestrator -> draft_proposer on every step;
* ``pard``: the shipped PARD draft (``models/tiny-draft-pard``, ``parallel_drafting``), one
  propose call a step, in draft_proposer;
* ``mtp``: the target's own MTP layer (``{"method": "mtp"}``, no model path), beside the
  target (``run_with_target``), where vLLM runs it: its hidden states never leave
  target_verifier's process. k = 3 over one layer chains the layer on its own output;
* ``peagle``: the shipped P-EAGLE head (``models/tiny-peagle``, ``eagle3`` with ``parallel_drafting``),
  one head pass a step, beside the target (``run_with_target``), compiled for CPU as shipped.

Each must give the target's greedy output, export per-position acceptance that adds up to
its accepted drafts, and give the same seeded sampled text streamed or not. The other
placement of each runs the same proposer in-process (``tests/test_draft_beside_target.py``).
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

import pytest
from client.generate import generate_grpc, generate_http
from triton_server import REPO_ROOT, models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

MAX_TOKENS = 32
ORCHESTRATOR = (("model", "speculative_decoding"),)
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\nimport sys\n\n\ndef main():\n",
    "Once upon a time",
    "1, 2, 3, 4, 5, 6, 7,",
]


@dataclass(frozen=True)
class Served:
    """One drafter as served: its ``speculative_config`` and what the server must show of it."""

    config: dict  # the JSON; a "model" is a directory name under the models directory
    needs: str  # the checkpoint it reads, under the models directory
    placement: dict[str, str] = field(default_factory=dict)  # draft_proposer keys the JSON has no key for
    logged: tuple[str, ...] = ()  # in the server's log: the drafter was built as configured
    holders: tuple[str, ...] = ("target_verifier", "draft_proposer")  # the models that hold sequences

    @property
    def k(self) -> int:
        return self.config["num_speculative_tokens"]


SERVED = {
    # K = 6, under the shipped drafter's block_size - 1 = 8
    "dflash": Served({"method": "dflash", "model": "tiny-dflash", "num_speculative_tokens": 6}, "tiny-dflash"),
    "pard": Served({"method": "draft_model", "model": "tiny-draft-pard", "num_speculative_tokens": 4,
                    "parallel_drafting": True}, "tiny-draft-pard",
                   logged=("parallel_drafting: ", "mask token 188 (pard_token)")),  # not a chain over the checkpoint
    "mtp": Served({"method": "mtp", "num_speculative_tokens": 3}, "tiny-target", {"run_with_target": "true"},
                  logged=("run_with_target: draft_proposer's mtp",), holders=("target_verifier",)),
    "peagle": Served({"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 4,
                      "parallel_drafting": True}, "tiny-peagle", {"run_with_target": "true"},
                     logged=("run_with_target: draft_proposer's eagle3", "in one forward (P-EAGLE), mask token 188"),
                     holders=("target_verifier",)),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(tmp_path_factory, request):
    """(the drafter, its server): the repository's method, draft_model and k left empty for the JSON to set."""
    drafter, models = SERVED[request.param], models_dir()
    if not (models / drafter.needs).is_dir():
        pytest.skip(f"{drafter.needs} not found under {models}")
    config = {**drafter.config, **({"model": str(models / drafter.config["model"])} if "model" in drafter.config else {})}
    workdir = tmp_path_factory.mktemp(f"server_{request.param}")
    # every step drafts the JSON's k (no k that follows acceptance, which reads the clock): a seed, the same text
    parameters = {"draft_model": "", "speculation_follows_acceptance": "false", **drafter.placement}
    repository = repository_copy(workdir, models, "", parameters=parameters)
    server = server_on_free_ports(workdir, repository, serve_args=(f"--speculative-config={json.dumps(config)}",))
    server.start()
    yield drafter, server
    server.stop()


def test_greedy_output_equals_the_targets_and_per_position_acceptance_adds_up(served, reference):
    drafter, server = served
    before = server.metrics()
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    results = [(prompt, generate_grpc(server.grpc_url, "ensemble", prompt, {**params, "stream": True}) if i % 2 else
                generate_http(server.http_url, "ensemble", prompt, {**params, "stream": False}))
               for i, prompt in enumerate(PROMPTS)]  # fmt: skip
    drafted, accepted = reference.drafts_of_greedy_outputs(results, MAX_TOKENS)
    assert 0 < accepted < drafted
    after = server.metrics()
    key = lambda i: ("spec_decode_num_accepted_tokens_per_pos", ORCHESTRATOR + (("position", str(i)),))  # noqa: E731
    per_position = [after[key(i)] - before.get(key(i), 0.0) for i in range(drafter.k)]
    # decreasing, and more than the first kept: a block, a parallel draft, or the MTP layer fed its own output
    assert per_position == sorted(per_position, reverse=True) and per_position[1] > 0, per_position
    assert sum(per_position) == accepted
    for model in ("speculative_decoding", *drafter.holders):
        assert after[("spec_decode_num_active_sequences", (("model", model),))] == 0, model
    log = server.log_path.read_text()
    assert all(line in log for line in drafter.logged), drafter.logged


def test_seeded_sampling_equals_itself_streamed_or_not(served):
    """Sampled drafts are drawn from each position's q with the step's seed, q reaches the sampler: the same text."""
    _, server = served
    params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "temperature": 0.9, "top_p": 0.95,
              "seed": 1234}  # fmt: skip
    for prompt in PROMPTS[:2]:
        streamed = generate_grpc(server.grpc_url, "ensemble", prompt, {**params, "stream": True})
        whole = generate_grpc(server.grpc_url, "ensemble", prompt, {**params, "stream": False})
        assert streamed.text == whole.text and streamed.total_draft_tokens > 0, prompt


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "kind": {"enum": ["note", "code", "story"]}}, "required": ["name", "kind"]}  # fmt: skip


def test_a_schema_is_drafted_under_where_the_drafter_runs_and_the_output_is_k0s(served):
    """The drafter follows a copy of the request's grammar (``specdec.guided_drafts``), in draft_proposer or
    beside the target (which then masks the rows after the drafts with it): drafts pass, and the greedy text
    is k = 0's with the same guide."""
    _, server = served
    params = {"max_tokens": 40, "exclude_input_in_output": True, "stream": False,
              "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}  # fmt: skip
    for prompt in PROMPTS[:2]:
        guided = generate_grpc(server.grpc_url, "ensemble", prompt, params)
        plain = generate_grpc(server.grpc_url, "ensemble", prompt, {**params, "num_speculative_tokens": 0})
        assert guided.text == plain.text and json.loads(guided.text)["kind"] in SCHEMA["properties"]["kind"]["enum"]
        assert guided.total_accepted_draft_tokens > 0, prompt
    assert "drafts without its grammar" not in server.log_path.read_text()


def test_serve_refuses_a_model_path_for_mtp_by_name_before_starting():
    """MTP's layers are the target's own: a ``model`` beside ``method: mtp`` is refused, naming both keys."""
    bad = json.dumps({"method": "mtp", "model": str(models_dir() / "tiny-draft")})
    done = subprocess.run([str(REPO_ROOT / "scripts" / "serve.sh"), "--speculative-config", bad],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "speculative_config key 'model' with method 'mtp'" in done.stderr, done.stderr
