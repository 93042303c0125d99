"""The step scheduler (specdec.scheduler) over scripted stages: what each step runs, and that output is unchanged.

The target here is a rule, ``next_token(prefix)``, and the draft guesses it right except
at every third position, so acceptance is partial and every path of a step is taken:
accepted drafts, a recovered token, a bonus token, plain steps. The stages answer from
each sequence's own state, so the tests do not depend on how requests encode tokens.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.engine import GenerationParams, SequenceState
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import SequenceCancelled, StepCapabilities, StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.types import Proposal, SamplingParams, VerifyResult

VOCAB = 50
K = 3


def next_token(prefix: list[int]) -> int:
    return (sum(prefix) * 7 + len(prefix)) % VOCAB


def draft_token(prefix: list[int]) -> int:
    right = next_token(prefix)
    return right if len(prefix) % 3 else (right + 1) % VOCAB


def greedy_reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class ScriptedStages:
    capabilities = StepCapabilities()

    def __init__(self):
        self.states: dict[str, SequenceState] = {}  # every submitted sequence, by seq_id
        self.calls: list[tuple[str, int]] = []  # (stage, sequences) of every call, in order
        self.released: list[str] = []
        self.responses: dict[str, list[int] | None] = {}  # what each release passed on
        self.failing: set[str] = set()  # seq_ids whose verify fails
        self.sampler = RejectionSampler()
        self.source: str | None = None  # what each proposal names as its source

    async def propose(self, requests):
        await asyncio.sleep(0)
        self.calls.append(("propose", len(requests)))
        proposals = []
        for request in requests:
            tokens = list(self.states[request.seq_id].token_ids)
            drafts = []
            for _ in range(request.num_tokens):
                drafts.append(draft_token(tokens + drafts))
            proposals.append(Proposal(torch.tensor(drafts, dtype=torch.long), source=self.source))
        return proposals

    async def verify(self, requests):
        await asyncio.sleep(0)
        self.calls.append(("verify", len(requests)))
        if any(r.seq_id in self.failing for r in requests):
            raise RuntimeError(f"verify failed for {sorted(self.failing)}")
        results = []
        for request in requests:
            sequence = self.states[request.seq_id].token_ids[: request.position] + list(request.token_ids)
            first = len(sequence) - request.num_logits
            argmax = [next_token(sequence[: first + i + 1]) for i in range(request.num_logits)]
            if request.sampling.greedy:
                results.append(VerifyResult(torch.tensor(argmax)))
            else:  # a point mass at the rule's token: sampling must then reproduce the rule
                probs = torch.zeros(request.num_logits, VOCAB)
                probs[torch.arange(request.num_logits), torch.tensor(argmax)] = 1.0
                results.append(VerifyResult(torch.tensor(argmax), probs))
        return results

    async def sample(self, calls):
        await asyncio.sleep(0)
        self.calls.append(("sample", len(calls)))
        return [self.sampler(c.draft_token_ids, c.draft_probs, c.verify, c.seed, position=c.position) for c in calls]

    async def release(self, ended):
        self.released.extend(ended)
        self.responses.update(ended)


def make_state(stages, seq_id, prompt, max_tokens=12, k=K, temperature=0.0):
    params = GenerationParams(max_tokens=max_tokens, num_speculative_tokens=k,
                              sampling=SamplingParams(temperature=temperature, seed=1))  # fmt: skip
    state = SequenceState(seq_id, prompt, params)
    stages.states[seq_id] = state
    return state


async def collect(sequence):
    return [step async for step in sequence.steps()]


def run_all(scheduler, states, cancelled=()):
    async def main():
        sequences = [scheduler.submit(state, lambda s=state: s.seq_id in cancelled) for state in states]
        return await asyncio.gather(*(collect(s) for s in sequences), return_exceptions=True)

    return asyncio.run(main())


PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


@pytest.mark.parametrize("k", [0, 1, K])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_sequence_gets_the_targets_own_tokens(k, temperature):
    stages = ScriptedStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    states = [make_state(stages, f"s{i}", p, max_tokens=9 + i, k=k, temperature=temperature)
              for i, p in enumerate(PROMPTS)]  # fmt: skip
    outcomes = run_all(scheduler, states)
    for state, steps in zip(states, outcomes):
        assert [t for step in steps for t in step.output.new_token_ids] == greedy_reference(state.prompt_ids,
                                                                                         state.params.max_tokens)
        assert steps[-1].output.finished and steps[-1].num_output_tokens == state.params.max_tokens
    assert sorted(stages.released) == sorted(s.seq_id for s in states)
    assert ("sample" in {c for c, _ in stages.calls}) == (temperature > 0)


def test_each_step_makes_one_propose_and_one_verify_call_for_every_running_sequence():
    stages, reports = ScriptedStages(), []
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None, on_step=reports.append)
    run_all(scheduler, [make_state(stages, f"s{i}", p, max_tokens=10) for i, p in enumerate(PROMPTS)])
    verifies = [n for stage, n in stages.calls if stage == "verify"]
    assert len(verifies) == len(reports)
    assert [r.num_sequences for r in reports] == verifies
    assert verifies[0] == len(PROMPTS)  # every prefill in one call
    # a propose call precedes every verify after the prefill, and carries the drafting sequences
    for report in reports[1:]:
        drafting = sum(1 for s in report.sequences if s.num_draft_tokens)
        assert report.calls["propose"][0] == drafting
    assert all(r.k == K for r in reports)
    assert sum(s.num_new_tokens for r in reports for s in r.sequences) == 10 * len(PROMPTS)


def test_each_sequence_s_step_reports_the_source_its_proposal_names():
    stages, reports = ScriptedStages(), []
    stages.source = "suffix"
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None, on_step=reports.append)
    run_all(scheduler, [make_state(stages, f"s{i}", p, max_tokens=10) for i, p in enumerate(PROMPTS)])
    steps = [s for r in reports for s in r.sequences]
    assert {s.source for s in steps if s.num_draft_tokens} == {"suffix"}
    assert {s.source for s in steps if not s.num_draft_tokens} == {None}  # prefills and the last steps: not proposed


def test_the_step_k_follows_the_batch_size_table_and_disable_by_batch_size():
    stages, reports = ScriptedStages(), []
    speculation = SpeculationLength(K, per_batch_size=((1, 3), (3, 1)), disable_by_batch_size=3)
    scheduler = StepScheduler(stages, speculation, max_num_seqs=None, on_step=reports.append)
    states = [make_state(stages, f"s{i}", p, max_tokens=4 + 6 * i) for i, p in enumerate(PROMPTS)]
    outcomes = run_all(scheduler, states)
    for report in reports:
        assert report.k == speculation.k_for(report.num_sequences)
        assert all(s.num_draft_tokens <= report.k for s in report.sequences)
        drafted = any(s.num_draft_tokens for s in report.sequences)
        assert ("propose" in report.calls) == drafted
        if report.k == 0:
            assert not drafted
    assert {r.num_sequences for r in reports} == {1, 2, 3, 4}
    assert {r.k for r in reports} == {0, 1, 3}
    for state, steps in zip(states, outcomes):  # unchanged output whatever k each step chose
        assert [t for step in steps for t in step.output.new_token_ids] == greedy_reference(state.prompt_ids,
                                                                                         state.params.max_tokens)


def test_no_more_than_max_num_seqs_run_and_the_rest_start_in_arrival_order():
    stages, reports = ScriptedStages(), []
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=2, on_step=reports.append)
    states = [make_state(stages, f"s{i}", p, max_tokens=6) for i, p in enumerate(PROMPTS)]
    outcomes = run_all(scheduler, states)
    assert max(r.num_sequences for r in reports) == 2
    assert stages.released[:2] == ["s0", "s1"] and sorted(stages.released[2:]) == ["s2", "s3"]
    assert all(steps[-1].output.finished for steps in outcomes)


def test_a_cancelled_sequence_is_released_and_the_others_go_on():
    stages = ScriptedStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    states = [make_state(stages, f"s{i}", p, max_tokens=10) for i, p in enumerate(PROMPTS)]
    outcomes = run_all(scheduler, states, cancelled={"s1"})
    assert isinstance(outcomes[1], SequenceCancelled)
    assert "s1" in stages.released
    for i in (0, 2, 3):
        assert [t for s in outcomes[i] for t in s.output.new_token_ids] == greedy_reference(PROMPTS[i], 10)
    # completed responses are passed on with their release (suffix decoding learns from them); a cancelled one is not
    assert stages.responses["s1"] is None
    assert all(stages.responses[f"s{i}"] == greedy_reference(PROMPTS[i], 10) for i in (0, 2, 3))


def test_a_failing_sequence_fails_alone():
    """The batched verify fails; sent again one by one, only the sequence at fault fails."""
    stages = ScriptedStages()
    stages.failing = {"s2"}
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    states = [make_state(stages, f"s{i}", p, max_tokens=8) for i, p in enumerate(PROMPTS)]
    outcomes = run_all(scheduler, states)
    assert isinstance(outcomes[2], RuntimeError) and "verify failed" in str(outcomes[2])
    for i in (0, 1, 3):
        assert [t for s in outcomes[i] for t in s.output.new_token_ids] == greedy_reference(PROMPTS[i], 8)
    assert sorted(stages.released) == ["s0", "s1", "s2", "s3"]
    assert stages.responses["s2"] is None  # a failed sequence teaches no proposer


def test_a_stage_answering_the_wrong_number_of_results_fails_those_sequences():
    stages = ScriptedStages()

    async def short_verify(requests):
        return (await ScriptedStages.verify(stages, requests))[:-1]

    stages.verify = short_verify
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    outcomes = run_all(scheduler, [make_state(stages, "s0", [1, 2])])
    assert isinstance(outcomes[0], RuntimeError) and "verify returned 0 results for 1" in str(outcomes[0])
    assert stages.released == ["s0"]


def test_greedy_steps_go_to_the_sampler_when_matching_here_is_off():
    stages = ScriptedStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None, match_greedy_here=False)
    outcomes = run_all(scheduler, [make_state(stages, "s0", [1, 2], max_tokens=6)])
    assert [t for s in outcomes[0] for t in s.output.new_token_ids] == greedy_reference([1, 2], 6)
    assert ("sample", 1) in stages.calls


class SamplingInVerifyStages(ScriptedStages):
    """Stages that judge sampled sequences inside the verify call, as the served ones do (sample_hop)."""

    capabilities = StepCapabilities(samples_in_verify=True)

    async def verify(self, requests):
        results = await ScriptedStages.verify(self, requests)
        for request, result in zip(requests, results):
            if request.sample_here is not None:
                drafts = torch.tensor(request.token_ids[len(request.token_ids) - request.num_logits + 1:])
                result.sampled = self.sampler(drafts, None, result, request.sample_here.seed,
                                              position=request.sample_here.position)
                result.probs = None  # p stays where it was made
        return results

    async def sample(self, calls):
        raise AssertionError("stages that sample in verify get no sample call")


@pytest.mark.parametrize("match_greedy_here", [True, False])
def test_stages_that_sample_in_verify_get_no_sample_call_and_the_same_tokens(match_greedy_here):
    stages = SamplingInVerifyStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None, match_greedy_here=match_greedy_here)
    states = [make_state(stages, f"s{i}", p, max_tokens=9, temperature=0.7 * (i % 2)) for i, p in enumerate(PROMPTS)]
    outcomes = run_all(scheduler, states)
    for state, steps in zip(states, outcomes):
        assert [t for step in steps for t in step.output.new_token_ids] == greedy_reference(state.prompt_ids, 9)
    assert "sample" not in {c for c, _ in stages.calls}
    assert states[1].stats.num_accepted_tokens > 0 and states[1].stats.num_accepted_tokens < states[1].stats.num_draft_tokens


def test_a_verify_call_that_skips_a_verdict_fails_that_sequence():
    stages = SamplingInVerifyStages()

    async def forgetful_verify(requests):
        return await ScriptedStages.verify(stages, requests)  # p back, no verdict

    stages.verify = forgetful_verify
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    outcomes = run_all(scheduler, [make_state(stages, "s0", [1, 2], temperature=0.7),
                                   make_state(stages, "s1", [3], max_tokens=4)])  # fmt: skip
    assert isinstance(outcomes[0], RuntimeError) and "no rejection-sampling verdict" in str(outcomes[0])
    assert [t for s in outcomes[1] for t in s.output.new_token_ids] == greedy_reference([3], 4)
    assert sorted(stages.released) == ["s0", "s1"]


def test_the_stream_ends_only_after_the_release():
    stages = ScriptedStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    state = make_state(stages, "s0", [3], max_tokens=5)
    release_may_finish = None

    async def slow_release(ended):
        await release_may_finish.wait()
        stages.released.extend(ended)

    stages.release = slow_release

    async def main():
        nonlocal release_may_finish
        release_may_finish = asyncio.Event()
        steps = scheduler.submit(state).steps()
        while not (await steps.__anext__()).output.finished:
            pass
        ending = asyncio.ensure_future(steps.__anext__())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not ending.done() and stages.released == []
        release_may_finish.set()
        with pytest.raises(StopAsyncIteration):
            await ending
        assert stages.released == ["s0"]

    asyncio.run(main())


def test_a_sequence_submitted_later_joins_the_running_loop():
    stages, reports = ScriptedStages(), []
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None, on_step=reports.append)
    first, second = make_state(stages, "s0", [1], max_tokens=20), make_state(stages, "s1", [2], max_tokens=4)

    async def main():
        running = asyncio.ensure_future(collect(scheduler.submit(first)))
        for _ in range(6):
            await asyncio.sleep(0)
        late = await collect(scheduler.submit(second))
        return await running, late

    steps_first, steps_second = asyncio.run(main())
    assert [t for s in steps_second for t in s.output.new_token_ids] == greedy_reference([2], 4)
    assert [t for s in steps_first for t in s.output.new_token_ids] == greedy_reference([1], 20)
    assert any(r.num_sequences == 2 for r in reports)


def test_an_abandoned_sequence_stops_at_the_next_step_and_is_released():
    stages = ScriptedStages()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    state = make_state(stages, "s0", [1, 2], max_tokens=40)

    async def main():
        sequence = scheduler.submit(state)
        steps = sequence.steps()
        await steps.__anext__()
        sequence.abandon()  # e.g. the client's stream broke while sending
        with pytest.raises(SequenceCancelled):
            async for _ in steps:
                pass

    asyncio.run(main())
    assert stages.released == ["s0"] and len(state.output_ids) < 40


class WithoutSample(SamplingInVerifyStages):
    """As the served stages: no sample method at all."""

    def __getattribute__(self, name):
        if name == "sample":
            raise AttributeError("these stages have no sample")
        return super().__getattribute__(name)


def test_stages_that_sample_in_verify_need_no_sample_method():
    stages = WithoutSample()
    scheduler = StepScheduler(stages, SpeculationLength(K), max_num_seqs=None)
    outcomes = run_all(scheduler, [make_state(stages, "s0", [1, 2], max_tokens=6, temperature=0.7)])
    assert [t for s in outcomes[0] for t in s.output.new_token_ids] == greedy_reference([1, 2], 6)
