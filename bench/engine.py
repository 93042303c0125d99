"""The step scheduler run in this process, without a server: what the engine itself costs.

Served, every step of ``specdec.scheduler.StepScheduler`` reaches the models through
Triton (a BLS request per stage). ``LocalStages`` gives the same scheduler the proposer,
the verifier and the rejection sampler as plain calls, so a phase measures the engine
alone: its forwards, CUDA graphs, rejection sampling and bookkeeping, with nothing of the
serving path. ``scripts/benchmark_engine.py`` compares configurations with it, on a
machine where no ``tritonserver`` needs to be installed (a lent GPU); the served figures
come from ``scripts/benchmark.py``. Nothing here imports ``tritonclient``.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from bench.stats import Acceptance, RequestTiming, latency_summary, source_figures
from specdec.engine import GenerationParams, SequenceState
from specdec.follow_acceptance import DraftLengths
from specdec.fast import FastCausalLM
from specdec.heads import HEAD_METHODS, build_head_proposer
from specdec.methods import METHODS
from specdec.proposers import (
    DraftModelProposer, NgramProposer, ParallelDraftProposer, SuffixConfig, SuffixProposer, read_mask_token,
)  # fmt: skip
from specdec.rejection_sampler import RejectionSampler
from specdec.scheduler import StepCapabilities, StepReport, StepScheduler
from specdec.speculation_length import SpeculationLength
from specdec.tree import DraftTree
from specdec.types import Proposal, ProposeRequest, SampleCall, SampleResult, VerifyRequest, VerifyResult


def build_proposer(method: str, args, max_num_seqs: int, max_model_len: int, cuda_graphs: bool | None,
                   tree: DraftTree | None = None, parallel: bool = False):  # fmt: skip
    """The proposer of ``method`` from the checkpoints ``args`` names (``draft``, ``eagle3``,
    ``mlp_speculator``, ``medusa``, ``dflash``, ``target``, ``dtype``, ``device``); ``cuda_graphs`` None: wherever CUDA is;
    ``tree``: the static tree a drafter drafts (``speculative_token_tree``); ``parallel``: ``parallel_drafting``,
    the draft model ``args.pard_draft`` (PARD) or the EAGLE-3 head ``args.peagle`` (P-EAGLE)."""
    if method == "draft_model":
        path = args.pard_draft if parallel else args.draft
        lm = FastCausalLM(path, args.dtype, args.device, max_num_seqs, max_model_len, cuda_graphs=cuda_graphs)
        return ParallelDraftProposer(lm, read_mask_token(path)) if parallel else DraftModelProposer(lm, tree)
    if method in HEAD_METHODS:
        # the head's directory: args.eagle3 (args.peagle in parallel), args.mlp_speculator, args.medusa or args.dflash;
        # MTP layers are the target's own
        path = args.peagle if parallel else args.target if METHODS[method].in_target_checkpoint else getattr(args, method)
        return build_head_proposer(method, path, args.target, args.dtype, args.device, max_num_seqs,
                                   cuda_graphs=cuda_graphs if args.device != "cpu" else None, tree=tree,
                                   parallel_drafting=parallel)  # fmt: skip
    if method == "ngram":
        return NgramProposer()
    return SuffixProposer(SuffixConfig(use_tree_spec=tree is not None))  # a tree: its own speculation tree


class LocalStages:
    """``specdec.scheduler.Stages`` over objects in this process: one owner each, called in step order."""

    # the scheduler sends every sampled (or synthetic) step to ``sample``; the proposer is here, beside the grammar
    capabilities = StepCapabilities(drafts_under_grammar=True)

    def __init__(self, verifier, sampler: RejectionSampler, proposer=None):
        self.verifier = verifier
        self.sampler = sampler
        self.proposer = proposer

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        await asyncio.sleep(0)  # readers take the last step's tokens now: their clock reads when it was delivered
        if not requests:
            return []
        if self.proposer is None:
            raise ValueError("a step asked for drafts, but these stages have no proposer (k must be 0)")
        return self.proposer.propose(requests)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        await asyncio.sleep(0)
        return self.verifier.verify(requests)

    async def sample(self, calls: list[SampleCall]) -> list[SampleResult]:
        return [
            self.sampler(c.draft_token_ids, c.draft_probs, c.verify,
                         c.seed if c.seed is not None else secrets.randbits(63), c.method, c.position,
                         c.parents)  # fmt: skip
            for c in calls
        ]

    async def release(self, ended: dict[str, list[int] | None]) -> None:
        for seq_id, response in ended.items():
            try:
                if self.proposer is not None:
                    self.proposer.release(seq_id, response)
            finally:
                self.verifier.release(seq_id)


@dataclass
class PhaseResult:
    """One closed-loop phase: every request's timing, output and acceptance, and every step's report."""

    timings: list[RequestTiming]
    outputs: list[list[int]]
    acceptance: Acceptance
    steps: list[StepReport] = field(default_factory=list)
    elapsed_s: float = 0.0

    def summary(self) -> dict:
        """Latency and throughput (``bench.stats.latency_summary``), acceptance and the steps' shape."""
        drafting = [s for s in self.steps if any(seq.num_draft_tokens for seq in s.sequences)]
        propose_s = sum(s.calls["propose"][1] for s in self.steps if "propose" in s.calls)
        verify_s = sum(s.calls["verify"][1] for s in self.steps if "verify" in s.calls)
        sequence_steps = sum(s.num_sequences for s in self.steps)  # one per sequence per step, prefills included
        return {
            **latency_summary(self.timings, self.elapsed_s),
            **self.acceptance.as_dict(),
            "steps": len(self.steps),
            "sequence_steps": sequence_steps,
            "mean_sequences_per_step": sequence_steps / len(self.steps) if self.steps else 0.0,
            "step_ms_mean": 1e3 * self.elapsed_s / len(self.steps) if self.steps else float("nan"),
            "propose_ms_per_drafting_step": 1e3 * propose_s / len(drafting) if drafting else 0.0,
            "verify_ms_per_step": 1e3 * verify_s / len(self.steps) if self.steps else float("nan"),
            **source_figures(self._by_source()),
        }

    def _by_source(self) -> dict[str, tuple[int, int, int]]:
        """``{source: (steps drafted, draft tokens, accepted tokens)}`` of the drafts that name a source."""
        out: dict[str, tuple[int, int, int]] = {}
        for sequence in (s for step in self.steps for s in step.sequences if s.source is not None and s.num_draft_tokens):
            steps, drafted, accepted = out.get(sequence.source, (0, 0, 0))
            out[sequence.source] = (steps + 1, drafted + sequence.num_draft_tokens, accepted + sequence.num_accepted)
        return out


def run_phase(
    stages: LocalStages,
    prompts: list[list[int]],
    params: GenerationParams,
    concurrency: int,
    hidden_layers: tuple[int, ...] = (),
    match_greedy_here: bool = True,
    name: str = "phase",
    follows_acceptance: bool = False,
    lengths: DraftLengths | None = None,
) -> PhaseResult:
    """Decode ``prompts`` closed loop, ``concurrency`` in flight, through one ``StepScheduler``.

    ``params.num_speculative_tokens`` is every step's k (the scheduler's table is that one
    value), or with ``follows_acceptance`` the most each sequence drafts, as its acceptance
    says (``specdec.follow_acceptance``). ``match_greedy_here`` False sends every step to
    the sampler, as a server whose rejection sampler runs the synthetic method must.
    ``lengths``: the scheduler's ``DraftLengths`` to carry on with (what it learned of the
    costs and the drafts' acceptance), as a server's scheduler carries it from request to
    request; None: a new one, which learns from nothing.
    """
    speculation = SpeculationLength(params.num_speculative_tokens, follows_acceptance=follows_acceptance)
    return asyncio.run(_run_phase(stages, prompts, params, concurrency, hidden_layers, match_greedy_here, name,
                                  speculation, lengths))  # fmt: skip


async def _run_phase(stages, prompts, params, concurrency, hidden_layers, match_greedy_here, name,
                     speculation, lengths) -> PhaseResult:  # fmt: skip
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    reports: list[StepReport] = []
    scheduler = StepScheduler(stages, speculation, max_num_seqs=concurrency, match_greedy_here=match_greedy_here,
                              on_step=reports.append)  # fmt: skip
    if lengths is not None:
        if lengths.speculation != speculation:
            raise ValueError(f"the lengths carried on were for {lengths.speculation}, not this phase's {speculation}")
        scheduler.lengths = lengths
    timings: list[RequestTiming | None] = [None] * len(prompts)
    states: list[SequenceState | None] = [None] * len(prompts)
    queue = list(enumerate(prompts))

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop(0)
            state = SequenceState(f"{name}-{i}", prompt, params, hidden_layers)
            timing = RequestTiming(sent=time.perf_counter())
            async for step in scheduler.submit(state).steps():
                timing.record(time.perf_counter(), len(step.output.new_token_ids))
            timings[i], states[i] = timing, state

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    elapsed = time.perf_counter() - started
    done = [s for s in states if s is not None]
    k = params.num_speculative_tokens
    per_position = [sum(s.stats.accepted_per_position[i] for s in done) for i in range(k)]
    acceptance = Acceptance(
        num_drafts=sum(1 for r in reports for s in r.sequences if s.num_draft_tokens),
        num_draft_tokens=sum(s.stats.num_draft_tokens for s in done),
        num_accepted_tokens=sum(s.stats.num_accepted_tokens for s in done),
        accepted_per_position=tuple(per_position),
    )
    return PhaseResult([t for t in timings if t is not None], [s.output_ids for s in done], acceptance, reports,
                       elapsed)  # fmt: skip
