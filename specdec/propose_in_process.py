"""Stages whose proposals come from a proposer in the caller's process: for model-free methods.

An n-gram or suffix proposer reads only the sequence's tokens, which the scheduler's
process holds, so its propose call can be a function call instead of a round trip to
another process (:mod:`specdec.proposers.model_free` says why it pays). Verify, sample
and release go on to the wrapped stages. The proposer is the one owner of its
sequences' state here: it hears every release, with the response of a request that
completed (suffix decoding learns from those), and the wrapped stages hold no proposer
state of their own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from specdec.proposers.base import Proposer
from specdec.scheduler import Stages, StepCapabilities
from specdec.types import Proposal, ProposeRequest, SampleCall, SampleResult, VerifyRequest, VerifyResult


class ProposeInProcess:
    def __init__(self, stages: Stages, proposer: Proposer, on_release: Callable[[Proposer], None] | None = None):
        """``on_release``: called after every release, e.g. to export what the proposer keeps (suffix trees).

        ``specdec.suffix_first.SuffixFirstStages`` runs its router here in the proposer's place.
        """
        self.stages = stages
        self.proposer = proposer
        self.on_release = on_release

    @property
    def capabilities(self) -> StepCapabilities:
        """The wrapped stages' sampling; the proposals are made here, so a step is never one call beside the target."""
        return replace(self.stages.capabilities, proposes_in_verify=False)

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return self.proposer.propose(requests)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return await self.stages.verify(requests)

    async def sample(self, calls: list[SampleCall]) -> list[SampleResult]:
        return await self.stages.sample(calls)

    async def release(self, ended: dict[str, list[int] | None]) -> None:
        for seq_id, response in ended.items():
            self.proposer.release(seq_id, response)
        if self.on_release is not None:
            self.on_release(self.proposer)
        await self.stages.release(ended)
