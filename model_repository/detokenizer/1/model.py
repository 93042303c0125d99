"""detokenizer: token ids -> text, decoded prefix-stably so that streaming can diff successive decodes."""
from specdec_triton import wire
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
        return answer(requests, wire.DETOKENIZE_INPUTS, self._detokenize)

    def _detokenize(self, inputs):
        token_ids = inputs["token_ids"].reshape(-1).tolist()
        if any(t < 0 for t in token_ids):
            raise RequestError(f"input 'token_ids' must be >= 0, got {[t for t in token_ids if t < 0][:8]}")
        return {"text_output": bytes_array([self.codec.decode(token_ids)])}
