"""Triton Python-backend plumbing for :mod:`specdec`; the served models live in ``model_repository/``.

* :mod:`~specdec_triton.plumbing` -- parameters, tensors, error responses, BLS, logging;
* :mod:`~specdec_triton.configs` -- one frozen config per served model;
* :mod:`~specdec_triton.wire` -- the tensors between the models;
* :mod:`~specdec_triton.request` -- the public generate I/O;
* :mod:`~specdec_triton.orchestrator` -- the serving loop, with no Triton import;
* :mod:`~specdec_triton.model_stages` -- its stages as calls to the composing models (BLS or socket);
* :mod:`~specdec_triton.socket_calls` -- step calls on a Unix socket;
* :mod:`~specdec_triton.metrics`, :mod:`~specdec_triton.text` -- custom metrics, tokenizer wrapper.

Everything imports without Triton; ``triton_python_backend_utils`` is loaded on first use.
"""
