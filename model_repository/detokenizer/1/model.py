"""detokenizer: token ids -> text, with the served tokenizer; a utility model for clients that hold ids.

A request carries one id list, or several packed ones (``num_token_ids``): one text each.
speculative_decoding does not call it: a streamed response's new text comes from the ids
of one step and the text already sent, which only the orchestrator holds, so it decodes
in its own process (:mod:`specdec.detokenize`); a call here per step would add a round
trip and still need that state.
"""
from specdec_triton.server_watch import exit_with_server

# First, before the imports below take seconds (torch): this process ends with the server, whatever stops
# it and whenever, a reload's new process still importing included.
exit_with_server()

from specdec_triton import text_wire
from specdec_triton.configs import TokenizerConfig
from specdec_triton.plumbing import ModelLogger, Parameters, RequestError, answer, bytes_array
from specdec_triton.text import TextCodec


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config = TokenizerConfig.from_parameters(Parameters.from_args(args))
        self.codec = TextCodec(config.tokenizer_dir)
        self.logger.info(f"tokenizer from {config.tokenizer_dir}")

    def execute(self, requests):
        return answer(requests, text_wire.DETOKENIZE_INPUTS, self._detokenize)

    def _detokenize(self, inputs):
        lists, vocab = text_wire.token_id_lists_of(inputs), len(self.codec.tokenizer)
        if any(t >= vocab for ids in lists for t in ids):
            raise RequestError(f"input 'token_ids' must be < {vocab} (the tokenizer's vocabulary)")
        texts = [self.codec.decode(token_ids) for token_ids in lists]
        return {"text_output": bytes_array(texts)}

    def finalize(self):
        self.logger.info("unloaded")
