"""The tensors between served models (specdec_triton.wire) and the committed config.pbtxt files, without Triton."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specdec.types import Proposal, ProposeRequest, SampleResult, SamplingParams, VerifyRequest, VerifyResult
from specdec_triton import configs, wire
from specdec_triton.plumbing import Parameters, RequestError
from specdec_triton.request import GENERATE_INPUTS, GENERATE_OUTPUTS

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
SAMPLING = SamplingParams(temperature=0.75, top_k=5, top_p=0.875)  # exact in float32, the wire type

MODELS = {  # model -> (inputs, outputs, config class or None)
    wire.TOKENIZER: (wire.TOKENIZE_INPUTS, wire.TOKENIZE_OUTPUTS, configs.TokenizerConfig),
    wire.DETOKENIZER: (wire.DETOKENIZE_INPUTS, wire.DETOKENIZE_OUTPUTS, configs.TokenizerConfig),
    wire.DRAFT_PROPOSER: (wire.PROPOSE_INPUTS, wire.PROPOSE_OUTPUTS, configs.DraftProposerConfig),
    wire.TARGET_VERIFIER: (wire.VERIFY_INPUTS, wire.VERIFY_OUTPUTS, configs.TargetVerifierConfig),
    wire.REJECTION_SAMPLER: (wire.SAMPLE_INPUTS, wire.SAMPLE_OUTPUTS, configs.RejectionSamplerConfig),
    "speculative_decoding": (GENERATE_INPUTS, GENERATE_OUTPUTS, configs.OrchestratorConfig),
    "ensemble": (GENERATE_INPUTS, GENERATE_OUTPUTS, None),
}


BATCHED = (wire.DRAFT_PROPOSER, wire.TARGET_VERIFIER)  # the models BlsStages calls with batched=True


def load_config(model: str) -> model_config_pb2.ModelConfig:
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize("model", sorted(MODELS))
def test_config_declares_exactly_the_wire_tensors(model):
    inputs, outputs, _ = MODELS[model]
    config = load_config(model)
    assert [t.name for t in config.input] == list(inputs)
    assert [t.name for t in config.output] == list(outputs)
    if model in BATCHED:  # one batch item per request, so that concurrent sequences share a forward
        assert config.max_batch_size > 0 and config.HasField("dynamic_batching")
        assert all(t.allow_ragged_batch for t in config.input if list(t.dims) == [-1])
    else:
        assert config.max_batch_size == 0


@pytest.mark.parametrize("model", sorted(m for m, (_, _, cls) in MODELS.items() if cls is not None))
def test_committed_parameters_parse(model, tmp_path):
    """Every committed key is known to the model's config class and its value is allowed."""
    for name in ("tiny-target", "tiny-draft"):
        (tmp_path / "models" / name).mkdir(parents=True)
    raw = {key: value.string_value for key, value in load_config(model).parameters.items()}
    params = Parameters(raw, base_dir=str(tmp_path / "model_repository"), component=model)
    MODELS[model][2].from_parameters(params)


def test_ensemble_maps_every_public_tensor_to_speculative_decoding():
    (step,) = load_config("ensemble").ensemble_scheduling.step
    assert step.model_name == "speculative_decoding"
    assert dict(step.input_map) == {name: name for name in GENERATE_INPUTS}
    assert dict(step.output_map) == {name: name for name in GENERATE_OUTPUTS}
    assert load_config("speculative_decoding").model_transaction_policy.decoupled


def test_propose_round_trip():
    request = ProposeRequest("s1", [1, 2, 3], 4, SAMPLING, seed=2**63 + 5)
    assert wire.propose_request_of(wire.propose_inputs(request)) == request
    banned = ProposeRequest("s1", [1, 2, 3], 4, SAMPLING, seed=1, num_banned_tokens=2, banned_token_ids=(0, 9))
    assert wire.propose_request_of(wire.propose_inputs(banned)) == banned
    q = torch.softmax(torch.randn(2, 7), dim=-1)  # [k, vocab]
    outputs = wire.proposal_outputs(Proposal(torch.tensor([3, 4]), q), max_num_seqs=8)
    back = wire.proposal_of(outputs)
    assert back.token_ids.tolist() == [3, 4] and torch.equal(back.probs, q)
    assert wire.optional_limit(outputs, "max_num_seqs") == 8
    one_hot = wire.proposal_of(wire.proposal_outputs(Proposal(torch.tensor([3]), None), max_num_seqs=None))
    assert one_hot.probs is None
    released = wire.proposal_outputs(None, max_num_seqs=None)
    assert len(wire.proposal_of(released).token_ids) == 0 and wire.optional_limit(released, "max_num_seqs") is None


def test_verify_round_trip_with_banned_rows_and_limits():
    request = VerifyRequest("s", 7, [5, 6], 2, SAMPLING, num_banned_rows=1, banned_token_ids=(0, 9))
    back = wire.verify_request_of(wire.verify_inputs(request))
    assert (back.seq_id, back.position, back.token_ids, back.num_logits) == ("s", 7, [5, 6], 2)
    assert (back.num_banned_rows, back.banned_token_ids, back.sampling) == (1, (0, 9), SAMPLING)
    p = torch.softmax(torch.randn(2, 7), dim=-1)  # [k + 1, vocab]
    outputs = wire.verify_outputs(VerifyResult(torch.tensor([1, 2]), p), None, vocab_size=7, max_num_seqs=4)
    result = wire.verify_result_of(outputs)
    assert result.argmax.tolist() == [1, 2] and torch.equal(result.probs, p)
    assert wire.optional_limit(outputs, "max_model_len") is None and wire.optional_limit(outputs, "max_num_seqs") == 4
    released = wire.verify_outputs(None, max_model_len=128, vocab_size=7, max_num_seqs=None)
    assert wire.verify_result_of(released).probs is None and wire.optional_limit(released, "max_model_len") == 128


def test_release_inputs():
    inputs = wire.release_inputs("abc")
    assert wire.is_release(inputs) and wire.seq_id_of(inputs) == "abc"
    assert not wire.is_release({"seq_id": inputs["seq_id"]})


def test_sample_call_defaults_and_errors():
    p = torch.softmax(torch.randn(3, 7), dim=-1)  # [k + 1, vocab]
    inputs = wire.sample_inputs(torch.tensor([1, 2]), None, VerifyResult(p.argmax(-1), p), seed=11)
    call = wire.sample_call_of(inputs)
    assert call.draft_probs is None and call.seed == 11 and call.method is None
    assert torch.equal(call.verify.probs, p)
    del inputs["target_token_ids"]  # standalone callers may send p alone: argmax is derived
    assert torch.equal(wire.sample_call_of(inputs).verify.argmax, p.argmax(-1))
    with pytest.raises(RequestError, match="'target_probs' or 'target_token_ids' is required"):
        wire.sample_call_of({"draft_token_ids": np.array([1])})
    inputs["rejection_sample_method"] = np.array([b"fastest"], dtype=np.object_)
    with pytest.raises(RequestError, match=r"'rejection_sample_method' must be one of \('strict'"):
        wire.sample_call_of(inputs)
    result = wire.sample_result_of(wire.sample_result_outputs(SampleResult(torch.tensor([4, 5]), 1)))
    assert result.output_token_ids.tolist() == [4, 5] and result.num_accepted == 1


def test_stop_words_round_trip():
    sequences = ((1, 2), (3,), (4, 5, 6))
    assert wire.stop_sequences_of(wire.stop_words_arrays(sequences)) == sequences
    assert wire.stop_sequences_of(wire.stop_words_arrays(())) == ()
