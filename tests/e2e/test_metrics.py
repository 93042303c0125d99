"""Through a real server: the spec_decode_* metrics appear on the metrics port and add up."""
from __future__ import annotations

import pytest
from client.generate import generate_grpc

pytestmark = pytest.mark.server

K = 8  # the committed num_speculative_tokens
ORCHESTRATOR = (("model", "speculative_decoding"),)


def counter(samples, name: str) -> float:
    return samples[(name, ORCHESTRATOR)]


def test_metrics_add_up(server):
    before = server.metrics()
    results = [
        generate_grpc(server.grpc_url, "ensemble", prompt, {"max_tokens": 24, "stream": stream})
        for prompt in ("Once upon a time", "def f(x):\n    return x", "1, 2, 3,")
        for stream in (False, True)
    ]
    after = server.metrics()
    delta = {name: counter(after, name) - counter(before, name) for name in (
        "spec_decode_num_steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_output_tokens",
    )}  # fmt: skip
    assert delta["spec_decode_num_output_tokens"] == sum(r.num_output_tokens for r in results)
    assert delta["spec_decode_num_draft_tokens"] == sum(r.total_draft_tokens for r in results) > 0
    assert delta["spec_decode_num_accepted_tokens"] == sum(r.total_accepted_draft_tokens for r in results)
    assert delta["spec_decode_num_accepted_tokens"] <= delta["spec_decode_num_draft_tokens"]
    drafts = delta["spec_decode_num_drafts"]
    assert drafts <= delta["spec_decode_num_draft_tokens"] <= K * drafts
    # every request has a prefill step that drafts nothing; every step emits at least one token
    assert drafts + len(results) <= delta["spec_decode_num_steps"] <= delta["spec_decode_num_output_tokens"]

    per_position = [after[("spec_decode_num_accepted_tokens_per_pos", ORCHESTRATOR + (("position", str(i)),))]
                    for i in range(K)]  # fmt: skip
    assert per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == counter(after, "spec_decode_num_accepted_tokens")
    for model in ("speculative_decoding", "target_verifier", "draft_proposer"):
        assert after[("spec_decode_num_active_sequences", (("model", model),))] == 0

    def stage_delta(name: str, stage: str) -> float:
        key = (name, ORCHESTRATOR + (("stage", stage),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert 0 < stage_delta("spec_decode_stage_calls", "verify") <= delta["spec_decode_num_steps"]
    assert stage_delta("spec_decode_stage_sequences", "verify") == delta["spec_decode_num_steps"]  # one per step
    # every decoding step asks for drafts (prefills do not); a suffix lookup may find none
    assert drafts <= stage_delta("spec_decode_stage_sequences", "propose") <= delta["spec_decode_num_steps"] - len(results)
    assert stage_delta("spec_decode_stage_calls", "sample") == 0  # greedy steps are matched in the orchestrator
    steps_by_size = [v - before.get(key, 0.0) for key, v in after.items() if key[0] == "spec_decode_steps_by_batch_size"]
    assert sum(steps_by_size) == stage_delta("spec_decode_stage_calls", "verify")  # one verify call per step
    for stage in ("propose", "verify"):
        assert stage_delta("spec_decode_stage_seconds", stage) > 0


def test_sampled_steps_are_judged_inside_the_verify_call(table_server):
    """A draft model's q and the target's p go to the sampler from the models: no sample call, same text each time."""
    before = table_server.metrics()
    params = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 99, "exclude_input_in_output": True}
    results = [generate_grpc(table_server.grpc_url, "ensemble", "def f(x):\n    return x", {**params, "stream": stream})
               for stream in (False, True, False)]  # fmt: skip
    after = table_server.metrics()

    def stage_delta(name: str, stage: str) -> float:
        key = (name, ORCHESTRATOR + (("stage", stage),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert results[0].text == results[1].text == results[2].text  # the same seed: the same draws
    assert sum(r.total_draft_tokens for r in results) > 0  # drafts with q were judged
    assert stage_delta("spec_decode_stage_calls", "sample") == 0
    assert stage_delta("spec_decode_stage_calls", "verify") > 0
    assert stage_delta("spec_decode_stage_calls", "propose") > 0
