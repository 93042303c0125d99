"""rejection_sampler: which drafts the target keeps, plus the recovered or bonus token.

A request carries one sequence or several packed ones (``wire``). Callable on its own:
draft_probs absent means one-hot q at the drafts; target_probs absent means a greedy
target given by target_token_ids; seed absent draws a fresh one. Every response names
the configured method; a request with no sequences asks for just that. A request with
``describe`` set gets the sampler's ``ModelDescription`` (its method; no checkpoint).

Served, ``q`` and ``p`` do not pass through the orchestrator (:mod:`specdec_triton.sample_hop`):
draft_proposer leaves each sequence's ``q`` here (``hold_draft_probs``), and
target_verifier's sample request names the sequences (``seq_id``) whose ``q`` to take.
Those requests carry the server's secret.
"""
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()

import secrets

from specdec.held_draft_probs import HeldDraftProbs
from specdec.rejection_sampler import RejectionSampler
from specdec.types import ModelDescription
from specdec_triton import sample_hop, wire
from specdec_triton.configs import RejectionSamplerConfig
from specdec_triton.health import register_stub
from specdec_triton.internal import boot_secret
from specdec_triton.plumbing import ModelLogger, ParameterError, Parameters, answer, instance_device


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config = RejectionSamplerConfig.from_parameters(Parameters.from_args(args))
        self.device = instance_device(args)
        if config.use_triton_kernel and self.device == "cpu":
            raise ParameterError(f"{args['model_name']}: parameter 'use_triton_kernel' needs a KIND_GPU instance")
        self.sampler = RejectionSampler(config.method, config.synthetic_acceptance_rate, config.use_triton_kernel)
        self.description = ModelDescription("", None, None, None, config.method)  # no checkpoint, no limits
        self.held = HeldDraftProbs()  # q that draft_proposer left for the step's sample request
        self.secret = boot_secret()
        register_stub(args["model_name"], args["model_config"])  # the orchestrator watches this process
        self.logger.info(f"{config} on {self.device}")

    def finalize(self):
        self.logger.info("unloaded")

    def execute(self, requests):
        return answer(requests, wire.SAMPLE_INPUTS + sample_hop.SAMPLER_SEQUENCE_INPUTS, self._sample)

    def _sample(self, inputs):
        if wire.is_describe(inputs):
            return wire.description_outputs(self.description)
        taken = []
        if sample_hop.names_sequences(inputs):
            sample_hop.check_sequence_caller(inputs, self.secret)
            if sample_hop.is_hold(inputs):
                sample_hop.hold(inputs, self.held)
                return wire.sample_result_outputs([], self.sampler.method)
            calls, taken = sample_hop.with_held_probs(wire.sample_calls_of(inputs), inputs, self.held)
        else:
            calls = wire.sample_calls_of(inputs)
        results = []
        for call in calls:  # one or more sequences
            call = call.to(self.device)
            seed = call.seed if call.seed is not None else secrets.randbits(63)
            results.append(self.sampler(call.draft_token_ids, call.draft_probs, call.verify, seed, call.method,
                                        call.position, call.parents))  # fmt: skip
        self.held.discard(taken)  # only now: a request that failed and is sent again finds its q
        return wire.sample_result_outputs(results, self.sampler.method)
