"""The orchestrator's stages as BLS requests to the composing models of the repository."""
from __future__ import annotations

import asyncio
import statistics
import time

from specdec.types import Proposal, ProposeRequest, SampleCall, SampleResult, VerifyRequest, VerifyResult
from specdec_triton import wire
from specdec_triton.orchestrator import Limits, Tokenized
from specdec_triton.plumbing import ModelLogger, bls, bytes_array, ensure_bls_threads

_THREADS_WITHOUT_SEQUENCE_LIMIT = 32  # sequences assumed for the BLS thread pool when the stages set no limit
_LIMITS_PROBE_SEQ_ID = ""  # releasing a sequence that never existed is a no-op that still reports limits


class BlsStages:
    def __init__(self, logger: ModelLogger):
        self.logger = logger

    async def tokenize(self, text: str, stop_words: tuple[str, ...]) -> Tokenized:
        inputs = {"text_input": bytes_array([text])}
        if stop_words:
            inputs["stop_words"] = bytes_array(stop_words)
        out = await bls(wire.TOKENIZER, inputs, wire.TOKENIZE_OUTPUTS)
        return Tokenized(
            prompt_ids=out["input_ids"].reshape(-1).tolist(),
            stop_token_sequences=wire.stop_sequences_of(out),
            eos_token_ids=tuple(out["end_ids"].reshape(-1).tolist()),
        )

    async def detokenize(self, token_id_lists: list[list[int]]) -> list[str]:
        out = await bls(wire.DETOKENIZER, wire.detokenize_inputs(token_id_lists), wire.DETOKENIZE_OUTPUTS)
        return wire.texts_of(out)

    async def limits(self, call_costs: bool = False) -> Limits:
        """The stages' limits; with ``call_costs`` also what their calls cost (measured on first asking)."""
        probe = wire.release_inputs([_LIMITS_PROBE_SEQ_ID])
        if call_costs:
            probe.update(wire.measure_call_costs_input())
        costs = wire.CALL_COST_OUTPUTS if call_costs else ()
        verifier, proposer, sampler = await asyncio.gather(
            bls(wire.TARGET_VERIFIER, probe, wire.VERIFY_OUTPUTS + costs, batched=True),
            bls(wire.DRAFT_PROPOSER, probe, wire.PROPOSE_OUTPUTS + costs, batched=True),
            bls(wire.REJECTION_SAMPLER, wire.sampler_probe_inputs(), wire.SAMPLE_OUTPUTS),
        )
        max_num_seqs = [n for n in (wire.optional_limit(m, "max_num_seqs") for m in (verifier, proposer)) if n]
        call_overhead_s = await self._round_trip_seconds() if call_costs else 0.0
        limits = Limits(
            max_model_len=wire.optional_limit(verifier, "max_model_len"),
            vocab_size=int(verifier["vocab_size"][0]),
            max_num_seqs=min(max_num_seqs, default=None),
            rejection_sample_method=wire.sampler_method_of(sampler),
            verify_costs=wire.call_costs_of(verifier) if call_costs else None,
            propose_costs=wire.call_costs_of(proposer) if call_costs else None,
            call_overhead_s=call_overhead_s,
        )
        # at most one call in flight per sequence, two while it is released
        ensure_bls_threads(2 * (limits.max_num_seqs or _THREADS_WITHOUT_SEQUENCE_LIMIT) + 4)
        return limits

    async def _round_trip_seconds(self, repeats: int = 5) -> float:
        """What a BLS call costs beyond its model's work: the median of releases of no sequence."""
        probe = wire.release_inputs([_LIMITS_PROBE_SEQ_ID])
        times = []
        for _ in range(repeats):
            started = time.monotonic()
            await bls(wire.TARGET_VERIFIER, probe, wire.VERIFY_OUTPUTS, batched=True)
            times.append(time.monotonic() - started)
        return statistics.median(times)

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = await bls(wire.DRAFT_PROPOSER, wire.propose_inputs(requests), wire.PROPOSE_OUTPUTS, batched=True)
        return wire.proposals_of(out)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        out = await bls(wire.TARGET_VERIFIER, wire.verify_inputs(requests), wire.VERIFY_OUTPUTS, batched=True)
        return wire.verify_results_of(out, [r.num_logits for r in requests])

    async def sample(self, calls: list[SampleCall]) -> list[SampleResult]:
        out = await bls(wire.REJECTION_SAMPLER, wire.sample_inputs(calls), wire.SAMPLE_OUTPUTS)
        return wire.sample_results_of(out)

    async def release(self, seq_id: str) -> None:
        """Frees the sequence in both models that hold state; failures are logged, never raised."""
        inputs = wire.release_inputs([seq_id])
        results = await asyncio.gather(
            bls(wire.DRAFT_PROPOSER, inputs, wire.PROPOSE_OUTPUTS, batched=True),
            bls(wire.TARGET_VERIFIER, inputs, wire.VERIFY_OUTPUTS, batched=True),
            return_exceptions=True,
        )
        for model, result in zip((wire.DRAFT_PROPOSER, wire.TARGET_VERIFIER), results):
            if isinstance(result, BaseException):
                self.logger.error(f"releasing seq {seq_id!r} in {model} failed: {result}")
