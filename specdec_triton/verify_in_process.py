"""Stages whose verify runs on a target held in the orchestrator's own process.

Served as a composing model, the target costs every step a BLS request to
``target_verifier``: the request and response cross two process boundaries, and the
verifier's Python turns tensors into requests and back. On a model small enough that a
forward takes a few milliseconds, that is a third of a step (docs/benchmarks.md). With
``run_in_orchestrator`` set on target_verifier, the orchestrator loads the target itself
(:mod:`specdec_triton.target_here`) and these stages call it directly.

One worker thread makes every call on the target, verify and release alike, in the order
they come: the KV cache keeps one owner, and the event loop stays free to admit requests
and stream responses while a forward runs. Sampled sequences are judged by ``judge``
(served: one request to rejection_sampler, which stays the one owner of the sampling rule
and its random numbers; ``p`` crosses one process boundary, as it does from
target_verifier). Tokenize, describe, propose and the other stateful models' releases go
on to the wrapped stages, which know not to ask target_verifier
(``BlsStages(target_here=...)``).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from specdec.types import Proposal, ProposeRequest, VerifyRequest, VerifyResult
from specdec.verifier import TargetVerifier

# (requests of one verify call, the target's results) -> the results with the sampled sequences judged
Judge = Callable[[list[VerifyRequest], list[VerifyResult]], list[VerifyResult]]


class VerifyInProcess:
    samples_in_verify = True  # sampled sequences are judged inside verify (by ``judge``): no sample stage

    def __init__(self, stages, verifier: TargetVerifier, judge: Judge):
        """``stages``: the orchestrator's stages for everything but the target (tokenize, describe, propose,
        the proposer's releases)."""
        self.stages = stages
        self.verifier = verifier
        self.judge = judge
        self._target_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-target")

    async def tokenize(self, text: str, stop_words: tuple[str, ...]):
        return await self.stages.tokenize(text, stop_words)

    async def describe(self):
        return await self.stages.describe()

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return await self.stages.propose(requests)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return await self._on_target_thread(self._verify_and_judge, requests)

    async def release(self, ended: dict[str, list[int] | None]) -> None:
        """Frees the sequences here and in the wrapped stages; both are tried before a failure is raised."""
        results = await asyncio.gather(self._on_target_thread(self._release, list(ended)), self.stages.release(ended),
                                       return_exceptions=True)  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        """Stop taking calls; one in progress finishes on its thread."""
        self._target_thread.shutdown(wait=False, cancel_futures=True)

    async def _on_target_thread(self, function, argument):
        return await asyncio.get_running_loop().run_in_executor(self._target_thread, function, argument)

    def _verify_and_judge(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        return self.judge(requests, self.verifier.verify(requests))

    def _release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.verifier.release(seq_id)
