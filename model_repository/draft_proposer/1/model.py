"""draft_proposer: k draft tokens per sequence from a draft model, a draft head, n-gram lookup or suffix trees.

Keeps each live sequence (its tokens, and a KV cache with method draft_model); a
propose request carries only the tokens not sent before, at ``position``, and a
request with ``release`` set frees the sequence. The model-free methods (ngram, suffix)
are configured here but run in the orchestrator's process, which holds the tokens
already (:mod:`specdec.proposers.model_free`): their description carries the settings. A request carries one or more
sequences (``wire``), and requests arrive in dynamic batches, so with the fast engine
all sequences drafting at the same moment share each forward. A request with
``describe`` set gets the proposer's ``ModelDescription``, which the orchestrator
checks against the target's; a head (eagle3, mlp_speculator) names there the target
hidden states it reads, which the orchestrator then asks target_verifier for and sends
along. A request with ``hold_draft_probs`` set sends each ``q`` drawn to rejection_sampler
instead of back (:mod:`specdec_triton.sample_hop`). A sequence with a grammar drafts under a copy of
it, whose guide its first request carries (``guide_spec``, :mod:`specdec.guided_drafts`). With ``run_with_target`` set for a
draft model or head, target_verifier loads it beside the target
(:mod:`specdec.draft_beside_target`), and this model holds nothing and answers every
request with an error saying so. Callers, releases and expiry:
:class:`specdec_triton.stateful.SequenceHost`.
"""
from specdec_triton.load_interrupt import LoadWatch
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()
LOAD_WATCH = LoadWatch()  # and a stop ends its load, a reload's included, instead of waiting for it

from specdec.compile_locks import set_lock_timeout
from specdec_triton import hidden_wire, sample_hop, wire
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.drafters import build_proposer, drafting_under_grammars
from specdec_triton.plumbing import ModelLogger, Parameters, ServingError, answer_batch, instance_device
from specdec_triton.stateful import SequenceHost


def _outputs(proposals):
    return {**wire.proposal_outputs(proposals), **sample_hop.held_outputs(proposals)}


def _refuse(batch):
    raise ServingError("draft_proposer sets run_with_target: the draft runs in target_verifier's process, and this "
                       "model holds no sequences")


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        LOAD_WATCH.log = self.logger.warning
        with LOAD_WATCH:
            self._load(args)

    def _load(self, args):
        config, device = DraftProposerConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        set_lock_timeout(config.compile_lock_timeout_s)  # this process's compiles (specdec.compile_locks)
        for warning in config.unread_settings():
            self.logger.warning(warning)
        self.runs_elsewhere = config.beside_target  # target_verifier loads the draft
        if self.runs_elsewhere:
            self.logger.info(f"run_with_target: {config.draft_model} is loaded by target_verifier, not here")
            return
        loaded = build_proposer(config, device, log=self.logger.info)
        self.proposer, description = drafting_under_grammars(loaded, config, self.logger.warning), loaded.description
        self.host = SequenceHost(args["model_name"], self.proposer, description, config.sequence_idle_timeout_s,
                                 self.logger, args["model_config"], keeps_responses=True,
                                 describe_extra=hidden_wire.draft_description_extras(description))
        self.send_to_sampler = sample_hop.sampler_sender(self.host.secret)
        self.host.serve_socket(self._propose)  # the orchestrator's step calls (specdec_triton.socket_calls)
        self.logger.info(f"{config} on {device}: {description}")

    def execute(self, requests):
        if self.runs_elsewhere:
            return answer_batch(requests, (), _refuse)
        names = wire.PROPOSE_INPUTS + hidden_wire.PROPOSE_HIDDEN_INPUTS + sample_hop.PROPOSE_HOLD_INPUTS
        responses = answer_batch(requests, names, self._propose)
        self.host.show_active()
        return responses

    def _propose(self, batch):
        propose = self._propose_and_hold if sample_hop.asks_to_hold(batch) else self.proposer.propose
        return self.host.handle(batch, lambda x: hidden_wire.with_hidden_states(wire.propose_requests_of(x), x),
                                propose, _outputs)  # fmt: skip

    def _propose_and_hold(self, requests):
        return sample_hop.hold_in_sampler(requests, self.proposer.propose(requests), self.send_to_sampler)

    def finalize(self):
        if not self.runs_elsewhere:
            self.host.close()
        self.logger.info("unloaded")  # the process ends next: every sequence's state goes with it
