"""speculative_decoding: the BLS orchestrator behind the public generate I/O.

Decoupled and async: each request runs :class:`specdec_triton.orchestrator.Orchestrator`
as its own coroutine, so many requests progress at once while each awaits its BLS
calls (tokenizer, draft_proposer, target_verifier, rejection_sampler, detokenizer).
"""
import asyncio
import json
import logging
import os

import triton_python_backend_utils as pb_utils

from specdec_triton.bls_stages import BlsStages
from specdec_triton.configs import OrchestratorConfig
from specdec_triton.internal import boot_secret
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters
from specdec_triton.orchestrator import Orchestrator
from specdec_triton.plumbing import (
    BlsError, ModelLogger, ParameterError, Parameters, cancellation_check, error_response, make_response,
    request_inputs,
)  # fmt: skip
from specdec.scheduler import SequenceCancelled
from specdec_triton.request import GENERATE_INPUTS, GenerateRequest, check_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        name = args["model_name"]
        self.logger = ModelLogger(name)
        # SPECDEC_LOG_LEVEL=DEBUG: the step scheduler logs every step's shape to the server's output
        logging.basicConfig(level=os.environ.get("SPECDEC_LOG_LEVEL", "WARNING").upper(),
                            format="[specdec] %(name)s %(levelname)s %(message)s")  # fmt: skip
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise ParameterError(f"{name}: needs model_transaction_policy {{ decoupled: true }}")
        config = OrchestratorConfig.from_parameters(Parameters.from_args(args))
        counters = SpecDecodeCounters(name, config.num_speculative_tokens)
        self.orchestrator = Orchestrator(
            BlsStages(self.logger, boot_secret()), config, counters, ActiveSequences(name), log=self.logger.info
        )
        self.logger.info(str(config))

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(request) for request in requests))

    async def _serve(self, request):
        """Runs one request to its final response: the last streamed text, the whole text, or an error."""
        sender = request.get_response_sender()
        finished = False

        def send(outputs, final):
            nonlocal finished
            sender.send(make_response(outputs), flags=FINAL if final else 0)
            finished = final

        try:
            ignored = self.orchestrator.config.ignored_request_parameters
            check_parameters(json.loads(request.parameters() or "{}"), ignored)
            generate_request = GenerateRequest.from_inputs(request_inputs(request, GENERATE_INPUTS))
            await self.orchestrator.generate(generate_request, send, cancellation_check(request))
        except Exception as err:
            if not isinstance(err, (ValueError, BlsError, SequenceCancelled)):
                self.logger.error(f"request failed: {err!r}")
            if not finished:
                sender.send(error_response(err), flags=FINAL)
