"""speculative_decoding: the BLS orchestrator behind the public generate I/O.

Decoupled and async: each request runs :class:`specdec_triton.orchestrator.Orchestrator`
as its own coroutine, so many requests progress at once while each awaits its calls to
the composing models (BLS requests; the step's calls to draft_proposer and
target_verifier on their sockets with ``stage_calls: socket``). A supervisor
thread watches the composing models' processes (:mod:`specdec_triton.recovery`).
"""
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()

import asyncio
import json
import logging
import os
import signal
import time

import triton_python_backend_utils as pb_utils

from specdec_triton import wire
from specdec_triton.model_stages import stages_for_placement
from specdec_triton.configs import OrchestratorConfig, read_draft_beside_target
from specdec_triton.health import StubWatch, reload_config
from specdec_triton.internal import boot_secret, remove_server_files
from specdec_triton.metrics import ActiveSequences, SpecDecodeCounters, SuffixCacheGauges
from specdec_triton.orchestrator import Orchestrator
from specdec_triton.plumbing import (
    BlsError, ModelLogger, ParameterError, Parameters, ServingError, cancellation_check, error_response, make_response,
    request_inputs,
)  # fmt: skip
from specdec_triton.recovery import SHUTTING_DOWN, RecoveryActions, Supervisor
from specdec.scheduler import SequenceCancelled
from specdec_triton.request import GENERATE_INPUTS, GenerateRequest, check_parameters
from specdec_triton.server_stop import (
    SERVER_NOT_READY, ServerStopWatch, answered_live_marker, http_liveness, http_model_readiness, wait_until_not_ready,
)  # fmt: skip

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WATCHED = (wire.TOKENIZER, wire.DRAFT_PROPOSER, wire.TARGET_VERIFIER, wire.REJECTION_SAMPLER)
UNLOAD_WAIT_S = 10.0  # a dead stub's instance unloads within a second or two
DRAIN_S = 5.0  # in finalize, requests still in flight this much longer get a final error; within the exit timeout


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
            self._stages(os.path.dirname(os.path.normpath(args["model_repository"])), config.stage_calls), config, counters,
            ActiveSequences(name), log=self.logger.info,
            suffix_gauges=SuffixCacheGauges(name),  # method suffix runs here (specdec.proposers.model_free)
        )
        # Triton's HTTP liveness, refused once stopping; its first answer is marked for a reload's load to see
        self.stop_watch = ServerStopWatch(http_liveness(), on_answer=lambda: answered_live_marker().touch())
        self.model_ready = http_model_readiness()
        if not self.stop_watch.watching:
            self.logger.info("no HTTP endpoint to watch: streams through ensemble end only at the exit timeout")
        actions = RecoveryActions(reload=self._reload,
                                  stop_server=lambda: os.kill(os.getppid(), signal.SIGTERM),
                                  log=self.logger.info, log_error=self.logger.error,
                                  server_stopping=self.stop_watch.check)  # fmt: skip
        self.supervisor = Supervisor(self.orchestrator, StubWatch(WATCHED), actions, config.on_stub_failure,
                                     config.health_check_interval_s).start()  # fmt: skip
        self.logger.info(str(config))

    def _reload(self, model):
        """Unloaded first, so the load is a fresh one: Triton counts the model loading, and strict readiness
        (``/v2/health/ready``) answers not ready until it serves. ``unload_model`` returns before the unload
        has begun; a load that comes first is taken as a reload of a model still counted ready, and the server
        would answer ready while every request fails, so the load waits until the model is answered not ready."""
        pb_utils.unload_model(model)
        if self.model_ready is not None and not wait_until_not_ready(self.model_ready, model, UNLOAD_WAIT_S):
            self.logger.error(f"{model} still answered ready {UNLOAD_WAIT_S:g} s after its unload; loading it anyway")
        pb_utils.load_model(model_name=model, config=reload_config(model))

    def _stages(self, repository_dir, stage_calls):
        """Requests to the composing models; with run_with_target, target_verifier holds the draft too."""
        beside = read_draft_beside_target(repository_dir) is not None
        self.model_stages = stages_for_placement(self.logger, boot_secret(), stage_calls, draft_beside_target=beside)
        return self.model_stages

    async def execute(self, requests):
        self.supervisor.loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._serve(request) for request in requests))

    async def _serve(self, request):
        """Runs one request to its final response: the last streamed text, the whole text, or an error."""
        sender = request.get_response_sender()
        finished = False

        def send(outputs, final):
            nonlocal finished
            sender.send(make_response(outputs), flags=FINAL if final else 0)
            finished = final

        limit = self.orchestrator.config.max_request_seconds
        deadline = time.monotonic() + limit if limit else float("inf")
        try:
            config = self.orchestrator.config
            parameters = json.loads(request.parameters() or "{}")
            client = parameters.pop(config.client_id_parameter, None) if config.client_id_parameter else None
            check_parameters(parameters, config.ignored_request_parameters)
            generate_request = GenerateRequest.from_inputs(request_inputs(request, GENERATE_INPUTS))
            cancelled = cancellation_check(request)
            await self.orchestrator.generate(generate_request, send, lambda: cancelled() or time.monotonic() > deadline,
                                             None if client is None else str(client))  # fmt: skip
        except Exception as err:
            self.supervisor.poke(str(err))
            if isinstance(err, SequenceCancelled) and time.monotonic() > deadline:
                err = SequenceCancelled(f"{err}: it ran longer than max_request_seconds={limit:g}")
            elif isinstance(err, BlsError) and SERVER_NOT_READY in str(err):  # Triton refuses BLS calls once stopping
                err = ServingError(f"{SHUTTING_DOWN}; the request was not finished ({err})")
            if not isinstance(err, (ValueError, BlsError, SequenceCancelled, ServingError)):
                self.logger.error(f"request failed: {err!r}")
            if not finished:
                sender.send(error_response(err), flags=FINAL)

    def finalize(self):
        """Stop watching; requests still running after ``DRAIN_S`` get a final error, so none waits forever."""
        self.supervisor.close()
        deadline = time.monotonic() + DRAIN_S
        while self.orchestrator.num_active_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.orchestrator.num_active_requests:
            self.logger.info(f"shutting down: ending {self.orchestrator.num_active_requests} request(s) in flight")
            self.supervisor.call_on_loop(self.orchestrator.stop_serving, SHUTTING_DOWN)
        self.model_stages.close()
        self.orchestrator.drop_metrics()
        if self.stop_watch.check():  # not on an unload by the repository API: the models keep using them
            remove_server_files()
        self.logger.info("unloaded")
