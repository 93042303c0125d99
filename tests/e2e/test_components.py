"""Through a real server: the composing models answer on their own, as their configs document."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.server

VOCAB = 6


def infer(server, model: str, batched: bool = False, **inputs) -> dict[str, np.ndarray]:
    """One request; ``batched``: a dynamically batched model, so every input gets a batch dimension of one."""
    tensors = []
    for name, array in inputs.items():
        array = array[None] if batched else array
        datatype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer(model, tensors)
    return {out.name: result.as_numpy(out.name) for out in result.get_response().outputs}


def one_hot(ids: list[int]) -> np.ndarray:  # [len(ids), VOCAB]
    return np.eye(VOCAB, dtype=np.float32)[ids]


def test_rejection_sampler_keeps_drafts_the_target_agrees_with(server):
    drafts = np.array([1, 2, 3], dtype=np.int64)
    # p agrees with the first two drafts, then puts all mass on token 5: accept 2, recover 5.
    out = infer(server, "rejection_sampler", draft_token_ids=drafts, target_probs=one_hot([1, 2, 5, 0]),
                seed=np.array([7], dtype=np.uint64))  # fmt: skip
    assert out["output_token_ids"].tolist() == [1, 2, 5] and out["num_accepted"].tolist() == [2]
    # Greedy without p: target_token_ids alone, every method reduces to strict matching.
    out = infer(server, "rejection_sampler", draft_token_ids=drafts, target_token_ids=np.array([1, 2, 3, 4]),
                rejection_sample_method=np.array([b"strict"], dtype=np.object_))  # fmt: skip
    assert out["output_token_ids"].tolist() == [1, 2, 3, 4] and out["num_accepted"].tolist() == [3]
    assert out["rejection_sample_method"].tolist() == [b"probabilistic"]  # the configured one, not the override


def test_rejection_sampler_probe_reports_its_method(server):
    """No sequences: nothing sampled, and the response names the configured method (the orchestrator asks)."""
    out = infer(server, "rejection_sampler", draft_token_ids=np.zeros(0, dtype=np.int64),
                num_draft_tokens=np.zeros(0, dtype=np.int32))  # fmt: skip
    assert out["output_token_ids"].size == 0 and out["num_accepted"].size == 0
    assert out["rejection_sample_method"].tolist() == [b"probabilistic"]


def test_rejection_sampler_is_seeded_and_validates_shapes(server):
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(VOCAB), size=3).astype(np.float32)  # [k, vocab]
    p = rng.dirichlet(np.ones(VOCAB), size=4).astype(np.float32)  # [k + 1, vocab]
    inputs = dict(draft_token_ids=np.array([0, 1, 2], dtype=np.int64), draft_probs=q, target_probs=p,
                  seed=np.array([123], dtype=np.uint64))  # fmt: skip
    first, second = infer(server, "rejection_sampler", **inputs), infer(server, "rejection_sampler", **inputs)
    assert first["output_token_ids"].tolist() == second["output_token_ids"].tolist()
    with pytest.raises(InferenceServerException, match=r"target_probs must have shape \[4, vocab\]"):
        infer(server, "rejection_sampler", **{**inputs, "target_probs": p[:3]})


def test_rejection_sampler_takes_packed_sequences(server):
    """Two sequences in one request: drafts concatenated with their counts, p rows of the flagged one only."""
    out = infer(server, "rejection_sampler",
                draft_token_ids=np.array([1, 2, 4], dtype=np.int64), num_draft_tokens=np.array([2, 1], dtype=np.int32),
                target_probs=one_hot([1, 3, 0]), has_target_probs=np.array([True, False]),
                target_token_ids=np.array([1, 3, 0, 4, 5], dtype=np.int64),
                seed=np.array([1, 2], dtype=np.uint64))  # fmt: skip
    # the first accepts draft 1 and recovers 3 from p; the greedy second accepts 4 and adds the bonus 5
    assert out["output_token_ids"].tolist() == [1, 3, 4, 5] and out["num_accepted"].tolist() == [1, 1]


def test_tokenizer_and_detokenizer_round_trip(server):
    text = "Grüße aus München 🚀"
    out = infer(server, "tokenizer", text_input=np.array([text.encode()], dtype=np.object_),
                stop_words=np.array([b"\n\n", b"end"], dtype=np.object_))  # fmt: skip
    assert len(out["stop_words_lens"]) == 2 and out["stop_words_lens"].sum() == len(out["stop_words_ids"])
    assert len(out["end_ids"]) >= 1
    decoded = infer(server, "detokenizer", token_ids=out["input_ids"])["text_output"][0].decode()
    assert decoded == text
    ids = out["input_ids"].tolist()
    packed = infer(server, "detokenizer", token_ids=np.array(ids + ids[:3], dtype=np.int64),
                   num_token_ids=np.array([len(ids), 3], dtype=np.int32))["text_output"]  # fmt: skip
    head = infer(server, "detokenizer", token_ids=np.array(ids[:3], dtype=np.int64))["text_output"][0]
    assert packed[0].decode() == text and packed[1] == head  # each list decodes as it does alone
