"""target_verifier: one target forward scores the last token and k drafts of every sequence in a batch.

Holds the KV cache of every live sequence; a request with ``release`` set frees one.
A request carries one or more sequences (``wire``), and requests arrive in dynamic
batches, so with the fast engine all sequences verifying at the same moment share one
forward. A request with ``describe`` set gets the target's ``ModelDescription``
(checkpoint, vocabulary, ``max_model_len``, ``max_num_seqs``), which the orchestrator
checks requests and the draft against. Callers, releases and expiry:
:class:`specdec_triton.stateful.SequenceHost`. A sampled sequence's ``p`` goes from here
to rejection_sampler, and its verdict comes back instead (:mod:`specdec_triton.sample_hop`).
When draft_proposer sets ``run_with_target``, this process loads the draft model or head
too, and each step comes as one call on the socket that proposes and verifies it
(:mod:`specdec.draft_beside_target`, :mod:`specdec_triton.beside_wire`); a release frees
the sequence in both models.
"""
from specdec_triton.load_interrupt import LoadWatch
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()
LOAD_WATCH = LoadWatch()  # and a stop ends its load, a reload's included, instead of waiting for it

import functools
import os

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.draft_beside_target import DraftBesideTarget
from specdec.verifier import TargetVerifier
from specdec.compile_locks import set_lock_timeout
from specdec_triton import beside_wire, hidden_wire, sample_hop, wire
from specdec_triton.configs import TargetVerifierConfig, read_draft_beside_target
from specdec_triton.internal import boot_secret
from specdec_triton.drafters import build_proposer, drafts_trees, grammar_compiler
from specdec_triton.plumbing import ModelLogger, Parameters, ServingError, answer_batch, instance_device
from specdec_triton.stateful import SequenceHost


def _outputs(results):
    """A draft head's hidden states travel back only to a request that asked for them."""
    return {**wire.verify_outputs(results), **hidden_wire.hidden_outputs(results), **sample_hop.sampled_outputs(results)}


def _requests_of(inputs):
    requests = hidden_wire.with_hidden_layers(wire.verify_requests_of(inputs), inputs)
    return sample_hop.with_sample_here(requests, inputs)


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        LOAD_WATCH.log = self.logger.warning
        with LOAD_WATCH:
            self._load(args)

    def _load(self, args):
        config, device = TargetVerifierConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        set_lock_timeout(config.compile_lock_timeout_s)  # this process's compiles (specdec.compile_locks)
        repository = os.path.dirname(os.path.normpath(args["model_repository"]))
        lm = build_lm(
            config.target_model, config.engine, config.dtype, device, config.max_num_seqs, config.max_model_len,
            log=self.logger.info, cpu_compile=config.cpu_compile, warm_trees=drafts_trees(repository),
        )
        self.verifier, description = TargetVerifier(lm), describe_lm(lm, config.target_model, "target")
        self.send_to_sampler = sample_hop.sampler_sender(boot_secret())
        self.beside = self._draft_beside(repository, device, config.target_model)
        self.host = SequenceHost(args["model_name"], self.beside or self.verifier, description,
                                 config.sequence_idle_timeout_s, self.logger, args["model_config"])  # fmt: skip
        self.host.serve_socket(self._serve)  # the orchestrator's step calls (specdec_triton.socket_calls)
        self.logger.info(f"{config} on {device}: {description}")

    def _draft_beside(self, repository_dir, device, target_model):
        """The draft model or head draft_proposer configures, when it sets run_with_target: loaded here. Its
        grammars are compiled for the target's tokenizer: their masks verify the rows after its drafts."""
        draft = read_draft_beside_target(repository_dir)
        if draft is None:
            return None
        loaded = build_proposer(draft, device, log=self.logger.info)
        description = loaded.description
        self.draft_describe_outputs = {**wire.description_outputs(description),
                                       **hidden_wire.draft_description_extras(description)}  # fmt: skip
        self.logger.info(f"run_with_target: draft_proposer's {description.method} {description.model} runs here")
        judge = functools.partial(sample_hop.sample_in_sampler, send=self.send_to_sampler)  # q and p in one request
        return DraftBesideTarget(self.verifier, loaded.proposer, description.hidden_state_layers, judge=judge,
                                 grammar_compiler=grammar_compiler(target_model, description.vocab_size),
                                 log=self.logger.warning)  # fmt: skip

    def execute(self, requests):
        names = wire.VERIFY_INPUTS + hidden_wire.VERIFY_HIDDEN_INPUTS + sample_hop.VERIFY_SAMPLE_INPUTS
        responses = answer_batch(requests, names, self._serve)
        self.host.show_active()
        return responses

    def _serve(self, batch):
        """A step with the draft beside (socket calls only), the draft's description, or verify requests."""
        if any(beside_wire.is_step(x) or beside_wire.is_describe_draft(x) for x in batch):
            if self.beside is None:
                raise ServingError("target_verifier holds no draft: draft_proposer did not set run_with_target when "
                                   "target_verifier loaded (reload target_verifier after changing it)")  # fmt: skip
            if len(batch) == 1 and beside_wire.is_describe_draft(batch[0]):
                return [self.draft_describe_outputs]
            return self.host.handle(batch, beside_wire.steps_of, self.beside.step, beside_wire.step_outputs)
        return self.host.handle(batch, _requests_of, self._verify_and_sample, _outputs)

    def _verify_and_sample(self, requests):
        return sample_hop.sample_in_sampler(requests, self.verifier.verify(requests), self.send_to_sampler)

    def finalize(self):
        self.host.close()
        self.logger.info("unloaded")  # the process ends next: every sequence's state goes with it
