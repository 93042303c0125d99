"""The scheduler's and orchestrator's stages as requests to the composing models of the repository.

One implementation of the step contract (``specdec.scheduler.Stages``) per placement of a
model drafter, each declaring its :class:`~specdec.types.StepCapabilities`:

* :class:`DraftInItsOwnModel` -- draft_proposer drafts and target_verifier verifies, a call each;
* :class:`DraftWithTheTarget` -- target_verifier holds the drafter too (draft_proposer's
  ``run_with_target``): a step is one call there (:mod:`specdec_triton.beside_wire`).

Both share everything but those calls (:class:`ModelStages`). Tokenize and describe are BLS
requests. A step's calls to the models that hold sequences go to the socket a model describes
when ``stage_calls`` is ``socket`` (:mod:`specdec_triton.socket_calls`: the same inputs and
outputs, without Triton's round trip), else as BLS requests. In both placements sampled
sequences are judged inside the verify call: ``q`` and ``p`` go to rejection_sampler from the
models that make them, and only the verdicts come back (:mod:`specdec_triton.sample_hop`), so
neither has a ``sample`` stage.
"""
from __future__ import annotations

import asyncio

from specdec.proposers.model_free import MODEL_FREE_METHODS
from specdec.types import ModelDescription, Proposal, ProposeRequest, VerifyRequest, VerifyResult
from specdec.draft_beside_target import ProposeVerify
from specdec.scheduler import StepCapabilities
from specdec_triton import beside_wire, hidden_wire, sample_hop, text_wire, wire
from specdec_triton.orchestrator import Descriptions, Tokenized
from specdec_triton.bls import bls, ensure_bls_threads
from specdec_triton.plumbing import ModelLogger, ServingError, bytes_array
from specdec_triton.socket_calls import SocketCallClient

_THREADS_WITHOUT_SEQUENCE_LIMIT = 32  # sequences assumed for the BLS thread pool when the stages set no limit
Described = tuple[ModelDescription, ModelDescription, dict[str, str | None]]  # draft, target, model -> socket


def stages_for_placement(logger: ModelLogger, secret: str, stage_calls: str, draft_beside_target: bool) -> ModelStages:
    """The stages of the placement draft_proposer's ``run_with_target`` names."""
    placement = DraftWithTheTarget if draft_beside_target else DraftInItsOwnModel
    return placement(logger, secret, stage_calls)


class ModelStages:
    """What both placements share: tokenize, describe, the connections, verify, release and renew."""

    capabilities: StepCapabilities

    def __init__(self, logger: ModelLogger, secret: str, stage_calls: str = "socket"):
        """``stage_calls``: ``socket`` to call the stateful models on the sockets they describe."""
        self.logger = logger
        self.stage_calls = stage_calls
        self._sockets: dict[str, SocketCallClient] = {}  # model -> its connection, made at describe
        self._secret = wire.secret_input(secret)  # sent with every request to a stateful model
        self._stateful = self._models_holding(draft=True)  # the models that hold sequences: released

    def _models_holding(self, draft: bool) -> tuple[str, ...]:
        """``draft``: the drafter holds sequences (a model-free method runs in the orchestrator and holds none)."""
        raise NotImplementedError

    async def _describe_holders(self, probe: dict) -> Described:
        raise NotImplementedError

    async def tokenize(self, text: str, stop_words: tuple[str, ...]) -> Tokenized:
        inputs = {"text_input": bytes_array([text])}
        if stop_words:
            inputs["stop_words"] = bytes_array(stop_words)
        out = await bls(wire.TOKENIZER, inputs, text_wire.TOKENIZE_OUTPUTS)
        return Tokenized(
            prompt_ids=out["input_ids"].reshape(-1).tolist(),
            stop_token_sequences=text_wire.stop_sequences_of(out),
            eos_token_ids=tuple(out["end_ids"].reshape(-1).tolist()),
        )

    async def describe(self) -> Descriptions:
        """Each composing model's description, asked of all at once; then the sockets to call on."""
        probe = wire.describe_inputs()
        tokenizer, (draft, target, sockets), sampler = await asyncio.gather(
            bls(wire.TOKENIZER, probe, wire.DESCRIBE_OUTPUTS),
            self._describe_holders(probe),
            bls(wire.REJECTION_SAMPLER, probe, wire.DESCRIBE_OUTPUTS),
        )
        descriptions = Descriptions(wire.description_of(tokenizer), draft, target, wire.description_of(sampler))
        # a model-free method runs in the orchestrator (specdec.propose_in_process): the model holds nothing;
        # a model holds its sequences, with suffix decoding in front of it (settings described) or not
        self._stateful = self._models_holding(draft=draft.method not in MODEL_FREE_METHODS)
        await self._connect(sockets)
        # a step's calls are few (one per stage), but finished sequences' releases and new
        # requests' tokenize calls run beside them
        ensure_bls_threads(2 * (descriptions.max_num_seqs or _THREADS_WITHOUT_SEQUENCE_LIMIT) + 4)
        return descriptions

    async def _describe_target(self, probe) -> tuple[ModelDescription, str | None]:
        out = await bls(wire.TARGET_VERIFIER, probe, wire.DESCRIBE_OUTPUTS + wire.DESCRIBE_SOCKET_OUTPUTS, batched=True)
        return wire.description_of(out), wire.socket_of(out)

    async def _connect(self, addresses: dict[str, str | None]) -> None:
        """Connections to the stateful models that describe a socket: kept while the model's socket is the
        same and the connection works (a release of the last run may still use it), else made anew."""
        wanted = {m: addresses.get(m) for m in self._stateful if self.stage_calls == "socket"}
        for model, client in list(self._sockets.items()):
            if wanted.get(model) != client.address or client.broken:
                client.close()
                del self._sockets[model]
        for model, address in wanted.items():
            if address is None:
                self.logger.warning(f"{model} describes no socket: its step calls go by BLS")
            elif model not in self._sockets:
                self._sockets[model] = await SocketCallClient.connect(model, address)

    def close(self) -> None:
        for client in self._sockets.values():
            client.close()
        self._sockets = {}

    async def _call(self, model: str, inputs: dict, names) -> dict:
        """A step call to a stateful model: on its socket when connected, else a BLS request."""
        client = self._sockets.get(model)
        if client is not None:
            return await client.call(inputs, names)
        return await bls(model, inputs, names, batched=True)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        # the argmax alone comes back: a sampled sequence carries sample_here, so its p stays behind
        names = wire.GREEDY_VERIFY_OUTPUTS
        names += wire.LOG_PROB_OUTPUTS if any(r.log_probs for r in requests) else ()
        sample_here = sample_hop.verify_sample_inputs(requests)  # judged by the sampler inside the call
        names += sample_hop.VERIFY_SAMPLE_OUTPUTS if sample_here else ()
        hidden = hidden_wire.verify_hidden_inputs(requests)  # the draft head's layers, if it reads any
        names = names + hidden_wire.VERIFY_HIDDEN_OUTPUTS if hidden else names
        inputs = {**wire.verify_inputs(requests), **hidden, **sample_here, **self._secret}
        out = await self._call(wire.TARGET_VERIFIER, inputs, names)
        results = sample_hop.attach_sampled(requests, wire.verify_results_of(out, [r.num_logits for r in requests]), out)
        return hidden_wire.attach_hidden(results, out, [len(r.token_ids) for r in requests]) if hidden else results

    async def release(self, ended: dict[str, list[int] | None]) -> None:
        """Frees the sequences in the models that hold state, one call each; a failure is logged and raised.

        The proposer also gets the responses of the requests that completed (suffix decoding
        learns from them); the verifier needs the ids alone.
        """
        inputs = {**wire.release_inputs(list(ended)), **self._secret}
        responses = wire.response_inputs(list(ended.values()))
        await self._to_every_holder(f"releasing {len(ended)} sequence(s)", inputs, {wire.DRAFT_PROPOSER: responses})

    async def renew(self, seq_ids: list[str]) -> None:
        """Tells the models that hold sequences that live requests still hold ``seq_ids`` (specdec_triton.leases)."""
        await self._to_every_holder(f"renewing {len(seq_ids)} sequence(s)", {**wire.renew_inputs(seq_ids),
                                                                              **self._secret})  # fmt: skip

    async def _to_every_holder(self, what: str, inputs: dict, extra: dict[str, dict] | None = None) -> None:
        """One call with ``inputs`` (and the model's ``extra``) to each model that holds sequences, at once;
        every failure is logged and raised together."""
        names = {wire.DRAFT_PROPOSER: wire.PROPOSE_OUTPUTS, wire.TARGET_VERIFIER: wire.VERIFY_OUTPUTS}
        results = await asyncio.gather(*(self._call(m, {**inputs, **(extra or {}).get(m, {})}, names[m])
                                         for m in self._stateful), return_exceptions=True)  # fmt: skip
        failures = [f"{model}: {result}" for model, result in zip(self._stateful, results)
                    if isinstance(result, BaseException)]  # fmt: skip
        if failures:
            self.logger.error(f"{what} failed: {'; '.join(failures)}")
            raise RuntimeError(f"{what} failed in {'; '.join(failures)}")


class DraftInItsOwnModel(ModelStages):
    """draft_proposer drafts (a model, or a model-free method's describe only) and target_verifier verifies."""

    capabilities = StepCapabilities(samples_in_verify=True)

    def _models_holding(self, draft: bool) -> tuple[str, ...]:
        return (wire.DRAFT_PROPOSER,) * draft + (wire.TARGET_VERIFIER,)

    async def _describe_holders(self, probe: dict) -> Described:
        (draft, draft_socket), (target, target_socket) = await asyncio.gather(self._describe_draft(probe),
                                                                              self._describe_target(probe))  # fmt: skip
        return draft, target, {wire.DRAFT_PROPOSER: draft_socket, wire.TARGET_VERIFIER: target_socket}

    async def _describe_draft(self, probe) -> tuple[ModelDescription, str | None]:
        names = hidden_wire.DRAFT_DESCRIBE_OUTPUTS + wire.DESCRIBE_SOCKET_OUTPUTS
        out = await bls(wire.DRAFT_PROPOSER, probe, names, batched=True)
        return hidden_wire.draft_description_of(out), wire.socket_of(out)

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        # the ids alone come back: greedy drafts have no q, and a sampled one's q goes to the sampler
        hold = sample_hop.propose_hold_inputs(requests)
        names = wire.GREEDY_PROPOSE_OUTPUTS + (sample_hop.PROPOSE_HOLD_OUTPUTS if hold else ())
        inputs = {**wire.propose_inputs(requests), **hidden_wire.propose_hidden_inputs(requests), **hold,
                  **self._secret}  # fmt: skip
        out = await self._call(wire.DRAFT_PROPOSER, inputs, names)
        return sample_hop.mark_held(wire.proposals_of(out), out)


class DraftWithTheTarget(ModelStages):
    """target_verifier holds the drafter beside the target, describes it on its socket and takes a step as one call.

    A model-free method never runs here (it runs in the orchestrator, and ``run_with_target`` changes nothing
    for it: ``configs.read_draft_beside_target``), so target_verifier holds every sequence: its releases free both.
    """

    capabilities = StepCapabilities(samples_in_verify=True, proposes_in_verify=True)

    def _models_holding(self, draft: bool) -> tuple[str, ...]:
        return (wire.TARGET_VERIFIER,)

    async def _describe_holders(self, probe: dict) -> Described:
        target, target_socket = await self._describe_target(probe)
        if self.stage_calls != "socket" or target_socket is None:
            why = (f"stage_calls is {self.stage_calls!r}" if self.stage_calls != "socket"
                   else "target_verifier describes no socket (its log says why)")  # fmt: skip
            raise ServingError(f"draft_proposer sets run_with_target, whose steps go to target_verifier's socket, and "
                               f"{why}: set stage_calls: socket, or run_with_target: false")  # fmt: skip
        await self._connect({wire.TARGET_VERIFIER: target_socket})
        out = await self._sockets[wire.TARGET_VERIFIER].call(beside_wire.describe_draft_inputs(),
                                                             hidden_wire.DRAFT_DESCRIBE_OUTPUTS)  # fmt: skip
        return hidden_wire.draft_description_of(out), target, {wire.TARGET_VERIFIER: target_socket}

    async def propose_and_verify(self, steps: list[ProposeVerify]) -> list[tuple[Proposal, VerifyResult]]:
        """A step as one call to target_verifier, which holds the draft beside the target."""
        out = await self._call(wire.TARGET_VERIFIER, {**beside_wire.step_inputs(steps), **self._secret},
                               beside_wire.step_output_names(steps))  # fmt: skip
        return beside_wire.step_results_of(steps, out)
