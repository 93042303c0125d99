"""tokenizer: text -> prompt token ids, plus stop words as id sequences and the default EOS ids.

A request with ``describe`` set gets the tokenizer's directory instead: the orchestrator
loads the same tokenizer to decode streamed text in its own process.
"""
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()

import os

import numpy as np

from specdec.types import ModelDescription
from specdec_triton import text_wire, wire
from specdec_triton.configs import TokenizerConfig
from specdec_triton.health import register_stub
from specdec_triton.plumbing import ModelLogger, Parameters, RequestError, answer, text, texts
from specdec_triton.text import TextCodec


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config = TokenizerConfig.from_parameters(Parameters.from_args(args))
        self.codec = TextCodec(config.tokenizer_dir)
        self.description = ModelDescription(
            os.path.realpath(config.tokenizer_dir), len(self.codec.tokenizer), None, None, "tokenizer"
        )
        register_stub(args["model_name"], args["model_config"])  # the orchestrator watches this process
        self.logger.info(f"tokenizer from {config.tokenizer_dir}, eos ids {self.codec.eos_token_ids}")

    def execute(self, requests):
        return answer(requests, text_wire.TOKENIZE_INPUTS, self._tokenize)

    def _tokenize(self, inputs):
        if wire.is_describe(inputs):
            return wire.description_outputs(self.description)
        if "text_input" not in inputs:
            raise RequestError("input 'text_input' is required")
        prompt_ids = self.codec.encode_prompt(text(inputs, "text_input", ""))
        stop_sequences = self.codec.encode_stop_words(texts(inputs, "stop_words") or [])
        return {
            "input_ids": np.asarray(prompt_ids, dtype=np.int64),  # [prompt_len]
            **text_wire.stop_words_arrays(stop_sequences),
            "end_ids": np.asarray(self.codec.eos_token_ids, dtype=np.int64),  # [num eos ids]
        }

    def finalize(self):
        self.logger.info("unloaded")
