"""The wire tensors of structured output (``specdec_triton.grammar_wire``): verification masks and guides."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.types import GuideSpec, ProposeRequest, SamplingParams, VerifyRequest
from specdec_triton import wire
from specdec_triton.plumbing import RequestError

GREEDY = SamplingParams()


def ask(seq_id, position, token_ids, spec=None):
    return ProposeRequest(seq_id, position, token_ids, 2, GREEDY, 0, guide_spec=spec)


def test_verify_round_trip_with_grammar_masks():
    mask = torch.tensor([[-1, 5], [7, 0]], dtype=torch.int32)  # [num_logits, words]
    requests = [VerifyRequest("a", 9, [5, 6], 2, GREEDY, allowed_tokens=mask), VerifyRequest("b", 0, [1], 1, GREEDY)]
    inputs = wire.verify_inputs(requests)
    assert inputs["num_allowed_rows"].tolist() == [2, 0] and inputs["allowed_tokens"].dtype == np.int32
    back = wire.verify_requests_of(inputs)
    assert torch.equal(back[0].allowed_tokens, mask) and back[1].allowed_tokens is None
    assert "allowed_tokens" not in wire.verify_inputs(requests[1:]), "requests without a grammar carry none"
    row0 = wire.verify_requests_of({**inputs, "num_allowed_rows": np.array([1, 1], np.int32)})  # drafted beside
    assert torch.equal(row0[0].allowed_tokens, mask[:1]) and torch.equal(row0[1].allowed_tokens, mask[1:])
    with pytest.raises(RequestError, match="'num_allowed_rows' is 2, but num_logits is 1"):
        wire.verify_requests_of({**inputs, "num_allowed_rows": np.array([0, 2], np.int32)})
    with pytest.raises(RequestError, match="'allowed_tokens' holds 3 words"):
        wire.verify_requests_of({**inputs, "allowed_tokens": np.zeros(3, np.int32)})


def test_a_guide_spec_that_is_not_one_is_refused_by_name():
    inputs = wire.propose_inputs([ask("s", 0, [1], GuideSpec("regex", "a", 1, (0,)))])
    assert wire.propose_requests_of(inputs)[0].guide_spec == GuideSpec("regex", "a", 1, (0,))
    inputs["guide_spec"] = np.array([b'{"type": "regex"}'], dtype=np.object_)
    with pytest.raises(RequestError, match="seq 's': input 'guide_spec' is not a guide"):
        wire.propose_requests_of(inputs)
