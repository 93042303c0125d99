"""Lossless speculative decoding: proposers, a target verifier, rejection sampling and the decode loop.

Layout (each stage speaks the dataclasses of :mod:`specdec.types`):

* :mod:`specdec.proposers` -- draft-model and n-gram proposers behind one protocol;
* :mod:`specdec.verifier` -- the target model scoring ``k + 1`` positions in one pass;
* :mod:`specdec.rejection_sampler` -- which drafts to keep (Leviathan et al. 2023);
* :mod:`specdec.engine` -- the per-request state machine and the in-process loop;
* :mod:`specdec.models` -- loading local checkpoints, one KV cache per sequence.

Submodules are imported on use, so importing the package stays cheap for the
Triton models that need only one stage.
"""
from specdec.types import (
    PLACEHOLDER_TOKEN_ID,
    Proposal,
    ProposeRequest,
    RequestStats,
    SampleResult,
    SamplingParams,
    VerifyRequest,
    VerifyResult,
)

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "Proposal",
    "ProposeRequest",
    "RequestStats",
    "SampleResult",
    "SamplingParams",
    "VerifyRequest",
    "VerifyResult",
]
