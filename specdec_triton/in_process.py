"""Stages whose verify, propose or both run on models held in the orchestrator's own process.

Served as composing models, the target and the draft cost every step a call each to
another process (a socket call, or a BLS request with ``stage_calls: bls``): the inputs
and outputs are framed and cross a process boundary twice, and the model's Python turns
them into requests and back. With ``run_in_orchestrator``
set on target_verifier or draft_proposer, the orchestrator loads that model itself
(:mod:`specdec_triton.models_here`) and these stages call it directly. A draft head then
reads the target's hidden states where the target left them: they cross no process.

One worker thread makes every call on the models here, proposes, verifies and releases
alike, in the order they come: each model's cache keeps one owner, and the event loop
stays free to admit requests and stream responses while a forward runs. Sampled
sequences keep rejection_sampler as the one owner of the sampling rule and its random
numbers: a draft here sends the ``q`` it drew there (``hold``), and a target here has
the sampled sequences judged there (``judge``), each in one request, as the composing
models do (:mod:`specdec_triton.sample_hop`). Everything else goes on to the wrapped
stages, which know not to ask the models held here (``ModelStages(target_here=...,
draft_here=...)``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from specdec.draft_beside_target import free_every
from specdec.types import Proposal, ProposeRequest, VerifyRequest, VerifyResult
from specdec.verifier import TargetVerifier

# (requests of one verify call, the target's results) -> the results with the sampled sequences judged
Judge = Callable[[list[VerifyRequest], list[VerifyResult]], list[VerifyResult]]
# (requests of one propose call, the proposals) -> the proposals with every q drawn sent to the sampler
Hold = Callable[[list[ProposeRequest], list[Proposal]], list[Proposal]]


class StagesInProcess:
    samples_in_verify = True  # sampled sequences are judged inside verify, here or by target_verifier

    def __init__(self, stages, verifier: TargetVerifier | None = None, judge: Judge | None = None,
                 proposer=None, hold: Hold | None = None):  # fmt: skip
        """``stages``: the orchestrator's stages for everything not held here (tokenize, describe, and the
        models' calls and releases for whichever of target and draft is not given)."""
        if (verifier is None) != (judge is None) or (proposer is None) != (hold is None):
            raise ValueError("a verifier here needs its judge, a proposer here its hold")
        self.stages = stages
        self.verifier = verifier
        self.judge = judge
        self.proposer = proposer
        self.hold = hold
        self._models_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-models")

    async def tokenize(self, text: str, stop_words: tuple[str, ...]):
        return await self.stages.tokenize(text, stop_words)

    async def describe(self):
        return await self.stages.describe()

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        if self.proposer is None:
            return await self.stages.propose(requests)
        return await self._on_models_thread(self._propose_and_hold, requests)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if self.verifier is None:
            return await self.stages.verify(requests)
        return await self._on_models_thread(self._verify_and_judge, requests)

    async def release(self, ended: dict[str, list[int] | None]) -> None:
        """Frees the sequences here and in the wrapped stages; both are tried before a failure is raised."""
        results = await asyncio.gather(self._on_models_thread(self._release, ended), self.stages.release(ended),
                                       return_exceptions=True)  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        """Stop taking calls; one in progress finishes on its thread."""
        self._models_thread.shutdown(wait=False, cancel_futures=True)

    async def _on_models_thread(self, function, argument):
        return await asyncio.get_running_loop().run_in_executor(self._models_thread, function, argument)

    def _propose_and_hold(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return self.hold(requests, self.proposer.propose(requests))

    def _verify_and_judge(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return self.judge(requests, self.verifier.verify(requests))

    def _release(self, ended: dict[str, list[int] | None]) -> None:
        """Every sequence is freed in every model here even if one release fails; the first failure is raised."""
        releases = [lambda s=seq_id: self.verifier.release(s) for seq_id in ended] if self.verifier is not None else []
        if self.proposer is not None:  # the response: a proposer may learn from it
            releases += [lambda s=seq_id, r=response: self.proposer.release(s, r) for seq_id, response in ended.items()]
        free_every(releases)
