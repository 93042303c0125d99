"""An OpenAI-compatible HTTP server in front of the Triton model repository.

``/v1/completions``, ``/v1/chat/completions`` (with the target's chat template) and
``/v1/models``, streamed as server-sent events or whole, each choice of a request mapped
onto one streamed gRPC request to ``ensemble`` or ``speculative_decoding``. Responses carry the
request's acceptance figures in a ``metrics.speculative_decoding`` object, as vLLM's
do. Run it with ``python -m specdec_openai`` or through ``scripts/serve.sh``.
"""
