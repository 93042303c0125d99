"""The tensors between served models (specdec_triton.wire) and the committed config.pbtxt files, without Triton."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specdec.penalties import Penalties
from specdec.types import (
    ModelDescription,
    Proposal,
    ProposeRequest,
    SampleCall,
    SampleHere,
    SampleResult,
    SamplingParams,
    VerifyRequest,
    VerifyResult,
)
from specdec_triton import configs, hidden_wire, sample_hop, text_wire, trtllm, wire
from specdec_triton.plumbing import Parameters, RequestError
from specdec_triton.request import GENERATE_INPUTS, GENERATE_OUTPUTS

# the inputs implemented under TensorRT-LLM's names, as its ensemble declares them
TRTLLM_NATIVE = {
    "text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]), "stream": ("TYPE_BOOL", [1]),
    "temperature": ("TYPE_FP32", [1]), "top_p": ("TYPE_FP32", [1]), "top_k": ("TYPE_INT32", [1]),
    "seed": ("TYPE_UINT64", [1]), "stop_words": ("TYPE_STRING", [-1]), "end_id": ("TYPE_INT32", [1]),
    "min_tokens": ("TYPE_INT32", [1]), "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "bad_words": ("TYPE_STRING", [-1]), "repetition_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]), "frequency_penalty": ("TYPE_FP32", [1]),
    "return_log_probs": ("TYPE_BOOL", [1]),
    "guided_decoding_guide_type": ("TYPE_STRING", [1]), "guided_decoding_guide": ("TYPE_STRING", [1]),
}  # fmt: skip
REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
SAMPLING = SamplingParams(temperature=0.75, top_k=5, top_p=0.875)  # exact in float32, the wire type

MODELS = {  # model -> (inputs, outputs, config class or None)
    wire.TOKENIZER: (text_wire.TOKENIZE_INPUTS, text_wire.TOKENIZE_OUTPUTS + wire.DESCRIBE_OUTPUTS, configs.TokenizerConfig),
    wire.DETOKENIZER: (text_wire.DETOKENIZE_INPUTS, text_wire.DETOKENIZE_OUTPUTS, configs.TokenizerConfig),
    wire.DRAFT_PROPOSER: (wire.PROPOSE_INPUTS + hidden_wire.PROPOSE_HIDDEN_INPUTS + sample_hop.PROPOSE_HOLD_INPUTS,
                          wire.PROPOSE_OUTPUTS + sample_hop.PROPOSE_HOLD_OUTPUTS + wire.DESCRIBE_OUTPUTS
                          + hidden_wire.DESCRIBE_HIDDEN_OUTPUTS + wire.DESCRIBE_SETTINGS_OUTPUTS
                          + wire.DESCRIBE_SOCKET_OUTPUTS,
                          configs.DraftProposerConfig),
    wire.TARGET_VERIFIER: (wire.VERIFY_INPUTS + hidden_wire.VERIFY_HIDDEN_INPUTS + sample_hop.VERIFY_SAMPLE_INPUTS,
                           wire.DECLARED_VERIFY_OUTPUTS + hidden_wire.VERIFY_HIDDEN_OUTPUTS
                           + sample_hop.VERIFY_SAMPLE_OUTPUTS + wire.DESCRIBE_OUTPUTS + wire.DESCRIBE_SOCKET_OUTPUTS,
                           configs.TargetVerifierConfig),
    wire.REJECTION_SAMPLER: (wire.SAMPLE_INPUTS + sample_hop.SAMPLER_SEQUENCE_INPUTS,
                             wire.SAMPLE_OUTPUTS + wire.DESCRIBE_OUTPUTS, configs.RejectionSamplerConfig),
    "speculative_decoding": (GENERATE_INPUTS, GENERATE_OUTPUTS, configs.OrchestratorConfig),
    "ensemble": (GENERATE_INPUTS, GENERATE_OUTPUTS, None),
}


BATCHED = (wire.DRAFT_PROPOSER, wire.TARGET_VERIFIER)  # the models ModelStages calls with batched=True


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
        # a request carries any number of sequences: every per-sequence input is ragged
        assert all(t.allow_ragged_batch for t in config.input if list(t.dims) == [-1])
        per_request = ["release", "renew", "describe", "caller_secret"]
        if model == wire.DRAFT_PROPOSER:
            per_request += sample_hop.PROPOSE_HOLD_INPUTS
        assert [t.name for t in config.input if list(t.dims) == [1]] == per_request
    if wire.DESCRIBE_OUTPUTS[0] in [t.name for t in config.output]:  # a describe request carries nothing else
        assert all(t.optional for t in config.input)
    elif model == "ensemble":  # TensorRT-LLM's shapes: a leading batch dimension of 1
        assert config.max_batch_size == 1
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


@pytest.mark.parametrize("model", ["ensemble", "speculative_decoding"])
def test_public_inputs_take_tensorrt_llm_datatypes_and_shapes(model):
    """A TensorRT-LLM client's tensors pass Triton's checks, so whatever is refused is refused by name."""
    declared = {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in load_config(model).input}
    for name, (datatype, dims) in {**trtllm.DECLARED, **TRTLLM_NATIVE}.items():
        assert declared[name] == (datatype, dims), name
    assert all(t.optional for t in load_config(model).input)


def test_ensemble_maps_every_public_tensor_to_speculative_decoding():
    (step,) = load_config("ensemble").ensemble_scheduling.step
    assert step.model_name == "speculative_decoding"
    assert dict(step.input_map) == {name: name for name in GENERATE_INPUTS}
    assert dict(step.output_map) == {name: name for name in GENERATE_OUTPUTS}
    assert load_config("speculative_decoding").model_transaction_policy.decoupled


GREEDY = SamplingParams()


def test_propose_round_trip_of_packed_sequences():
    requests = [
        ProposeRequest("s1", 0, [1, 2, 3], 4, SAMPLING, seed=2**63 + 5),
        ProposeRequest("s2", 17, [7], 2, GREEDY, seed=1, num_banned_tokens=2, banned_token_ids=(0, 9)),
        ProposeRequest("s3", 5, [], 0, GREEDY, seed=3, num_banned_tokens=1, banned_token_ids=(8,)),
    ]
    inputs = wire.propose_inputs(requests)
    assert inputs["position"].tolist() == [0, 17, 5] and inputs["token_ids"].tolist() == [1, 2, 3, 7]
    assert wire.propose_requests_of(inputs) == requests
    assert "banned_token_ids" not in wire.propose_inputs(requests[:1])  # no bans, no ban inputs
    q = torch.softmax(torch.randn(2, 7), dim=-1)  # [k, vocab]
    proposals = [Proposal(torch.tensor([3, 4]), q), Proposal(torch.tensor([5]), None), Proposal(torch.tensor([]))]
    outputs = wire.proposal_outputs(proposals)
    assert set(outputs) == set(wire.PROPOSE_OUTPUTS)
    back = wire.proposals_of(outputs)
    assert [p.token_ids.tolist() for p in back] == [[3, 4], [5], []]
    assert torch.equal(back[0].probs, q) and back[1].probs is None and back[2].probs is None
    assert wire.proposals_of(wire.proposal_outputs([])) == []


def test_greedy_requests_leave_out_the_sampling_inputs_and_seeds():
    greedy = [ProposeRequest("a", 0, [1, 2], 2, GREEDY, seed=0), ProposeRequest("b", 3, [4], 1, GREEDY, seed=0)]
    inputs = wire.propose_inputs(greedy)
    assert not {"temperature", "top_k", "top_p", "seed"} & set(inputs)
    assert wire.propose_requests_of(inputs) == greedy
    mixed = [greedy[0], ProposeRequest("c", 0, [5], 1, SAMPLING, seed=9)]
    assert wire.propose_requests_of(wire.propose_inputs(mixed)) == mixed
    outputs = wire.proposal_outputs([Proposal(torch.tensor([3, 4])), Proposal(torch.tensor([5]))])
    asked = {name: outputs[name] for name in wire.GREEDY_PROPOSE_OUTPUTS}  # what ModelStages asks of greedy calls
    assert [p.token_ids.tolist() for p in wire.proposals_of(asked)] == [[3, 4], [5]]
    results = wire.verify_outputs([VerifyResult(torch.tensor([1, 2])), VerifyResult(torch.tensor([3]))])
    asked = {name: results[name] for name in wire.GREEDY_VERIFY_OUTPUTS}
    back = wire.verify_results_of(asked, [2, 1])
    assert [r.argmax.tolist() for r in back] == [[1, 2], [3]] and back[0].probs is None
    verify = [VerifyRequest("a", 0, [1], 1, GREEDY)]
    assert not {"temperature", "top_k", "top_p"} & set(wire.verify_inputs(verify))
    assert wire.verify_requests_of(wire.verify_inputs(verify)) == verify


def test_a_lone_sequence_may_leave_out_the_counts():
    """A client calling a model on its own sends one sequence the short way: no num_* inputs."""
    inputs = {"seq_id": np.array([b"s"], dtype=np.object_), "token_ids": np.array([1, 2, 3]),
              "num_tokens": np.array([2], dtype=np.int32)}  # fmt: skip
    (request,) = wire.propose_requests_of(inputs)
    assert (request.seq_id, request.position, request.token_ids, request.num_tokens, request.sampling) == (
        "s", 0, [1, 2, 3], 2, GREEDY
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_token_ids": None}, r"'num_token_ids' is required when a request carries 2 sequences"),
        ({"num_token_ids": np.array([1, 1], dtype=np.int32)}, r"'token_ids' holds 3 values but .* add up to 2"),
        ({"num_tokens": np.array([2], dtype=np.int32)}, r"'num_tokens' must hold one value per sequence \(2\), got 1"),
        ({"temperature": np.array([0.5, np.nan], dtype=np.float32)}, r"'temperature' must hold finite numbers"),
        ({"seq_id": np.array([], dtype=np.object_)}, r"'seq_id' is required and must name at least one sequence"),
        ({"position": np.array([3], dtype=np.int64)}, r"'position' must hold one value per sequence \(2\), got 1"),
    ],
)
def test_packed_inputs_are_checked(change, message):
    inputs = wire.propose_inputs([ProposeRequest("a", 0, [1, 2], 1, GREEDY, 0), ProposeRequest("b", 4, [3], 1, GREEDY, 0)])
    for name, value in change.items():
        inputs.pop(name) if value is None else inputs.update({name: value})
    with pytest.raises(RequestError, match=message):
        wire.propose_requests_of(inputs)


def test_verify_round_trip_with_banned_rows():
    requests = [
        VerifyRequest("s", 7, [5, 6], 2, SAMPLING, num_banned_rows=1, banned_token_ids=(0, 9)),
        VerifyRequest("t", 0, [1, 2, 3, 4], 1, GREEDY),
    ]
    assert wire.verify_requests_of(wire.verify_inputs(requests)) == requests
    p = torch.softmax(torch.randn(2, 7), dim=-1)  # [k + 1, vocab]
    results = [VerifyResult(torch.tensor([1, 2]), p), VerifyResult(torch.tensor([3]), None)]
    outputs = wire.verify_outputs(results)
    assert set(outputs) == set(wire.DECLARED_VERIFY_OUTPUTS)
    back = wire.verify_results_of(outputs, [2, 1])
    assert [r.argmax.tolist() for r in back] == [[1, 2], [3]]
    assert torch.equal(back[0].probs, p) and back[1].probs is None
    assert wire.verify_results_of(wire.verify_outputs([]), []) == []
    with pytest.raises(RequestError, match=r"'target_probs' must have 3 rows .* got shape \[2, 7\]"):
        wire.verify_results_of({**outputs, "has_target_probs": np.array([True, True])}, [2, 1])


def test_verify_round_trip_with_penalties_and_log_probs():
    penalties = Penalties(repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.25,
                          bad_words=((3,), (4, 5, 6)))  # fmt: skip
    requests = [
        VerifyRequest("a", 9, [5, 6], 2, SAMPLING, penalties=penalties, num_prompt_tokens=4, log_probs=True),
        VerifyRequest("b", 0, [1, 2], 1, GREEDY),
        VerifyRequest("c", 3, [7], 1, GREEDY, penalties=Penalties(bad_words=((8, 9),)), num_prompt_tokens=2),
    ]
    inputs = wire.verify_inputs(requests)
    assert inputs["bad_words_lens"].tolist() == [1, 3, 2] and inputs["num_bad_words"].tolist() == [2, 0, 1]
    assert wire.verify_requests_of(inputs) == requests
    assert not set(wire.verify_inputs(requests[1:2])) & set(wire.PENALTY_INPUTS), "plain steps carry none"
    with pytest.raises(RequestError, match="num_bad_words"):
        wire.verify_requests_of({**inputs, "num_bad_words": np.array([2, 0, 2], np.int32)})
    mass = torch.tensor([-0.5, -1.25])
    results = [VerifyResult(torch.tensor([1, 2]), None, mass), VerifyResult(torch.tensor([3]), None),
               VerifyResult(torch.tensor([4]), None, torch.tensor([-2.0]))]  # fmt: skip
    back = wire.verify_results_of(wire.verify_outputs(results), [2, 1, 1])
    assert torch.equal(back[0].log_mass, mass) and back[1].log_mass is None and back[2].log_mass.tolist() == [-2.0]
    unasked = {k: v for k, v in wire.verify_outputs(results).items() if k not in wire.LOG_PROB_OUTPUTS}
    assert all(r.log_mass is None for r in wire.verify_results_of(unasked, [2, 1, 1]))


def test_release_inputs():
    inputs = wire.release_inputs(["abc", "d"])
    assert wire.is_release(inputs) and wire.seq_ids_of(inputs) == ["abc", "d"]
    assert not wire.is_release({"seq_id": inputs["seq_id"]})
    assert wire.responses_of(inputs) == [[], []]  # none sent: nothing to learn
    with_responses = {**inputs, **wire.response_inputs([[5, 6, 7], None])}
    assert wire.responses_of(with_responses) == [[5, 6, 7], []]
    with pytest.raises(RequestError, match="'token_ids' holds 3 values"):
        wire.responses_of({**with_responses, "num_token_ids": np.array([1, 1], np.int32)})


@pytest.mark.parametrize(
    "desc",
    [
        ModelDescription("/models/tiny-target", 256, 2048, 8, "target"),
        ModelDescription("/models/tiny-draft", 256, None, None, "draft_model"),
        ModelDescription("ngram", None, None, None, "ngram"),
        ModelDescription("", None, None, None, "probabilistic"),
    ],
)
def test_describe_round_trip(desc):
    inputs = wire.describe_inputs()
    assert wire.is_describe(inputs) and not wire.is_describe(wire.release_inputs(["a"]))
    outputs = wire.description_outputs(desc)
    assert set(outputs) == set(wire.DESCRIBE_OUTPUTS)
    assert wire.description_of(outputs) == desc
    if desc.max_model_len is None:
        assert outputs["describe_max_model_len"].tolist() == [-1]  # -1 encodes None


@pytest.mark.parametrize("settings", [(), (("max_tree_depth", 24), ("max_spec_factor", 1.0), ("min_token_prob", 0.1))])
def test_a_proposers_settings_round_trip(settings):
    desc = ModelDescription("suffix", None, None, None, "suffix", settings=settings)
    outputs = wire.settings_outputs(desc)
    assert set(outputs) == set(wire.DESCRIBE_SETTINGS_OUTPUTS)
    described = wire.with_described_settings(replace(desc, settings=()), outputs)
    assert described == desc and [type(v) for _, v in described.settings] == [type(v) for _, v in settings]


@pytest.mark.parametrize("text", ["[1, 2]", "{\"a\": \"x\"}", "{\"a\": null}", "not json"])
def test_described_settings_that_are_not_named_numbers_are_refused(text):
    with pytest.raises(ValueError, match="describe_settings must be a JSON object of numbers"):
        wire.with_described_settings(ModelDescription("ngram", None, None, None, "ngram"),
                                     {"describe_settings": np.array([text.encode()], dtype=np.object_)})


def test_sample_round_trip_of_packed_sequences():
    p = torch.softmax(torch.randn(3, 7), dim=-1)  # [k + 1, vocab]
    q = torch.softmax(torch.randn(1, 7), dim=-1)  # [k, vocab]
    calls = [
        SampleCall(torch.tensor([1, 2]), None, VerifyResult(p.argmax(-1), p), seed=11),
        SampleCall(torch.tensor([4]), q, VerifyResult(torch.tensor([4, 0]), None), seed=12),
        SampleCall(torch.tensor([], dtype=torch.long), None, VerifyResult(torch.tensor([6]), None), seed=13),
    ]
    back = wire.sample_calls_of(wire.sample_inputs(calls))
    assert [c.draft_token_ids.tolist() for c in back] == [[1, 2], [4], []]
    assert back[0].draft_probs is None and torch.equal(back[1].draft_probs, q) and back[2].draft_probs is None
    assert torch.equal(back[0].verify.probs, p) and back[1].verify.probs is None
    assert [c.verify.argmax.tolist() for c in back] == [p.argmax(-1).tolist(), [4, 0], [6]]
    assert [c.seed for c in back] == [11, 12, 13] and {c.method for c in back} == {None}
    results = [SampleResult(torch.tensor([4, 5]), 1), SampleResult(torch.tensor([7]), 0)]
    outputs = wire.sample_result_outputs(results, "strict")
    back_results = wire.sample_results_of(outputs)
    assert [(r.output_token_ids.tolist(), r.num_accepted) for r in back_results] == [([4, 5], 1), ([7], 0)]
    assert outputs["rejection_sample_method"][0] == b"strict"
    with pytest.raises(ValueError, match="one rejection_sampler request takes one method"):
        wire.sample_inputs([calls[0], SampleCall(torch.tensor([1]), None, calls[1].verify, 0, "strict")])


def test_sample_positions_round_trip_and_a_negative_one_is_refused():
    verify = VerifyResult(torch.tensor([3, 4]), None)
    calls = [SampleCall(torch.tensor([3]), None, verify, seed=1, position=p) for p in (5, None, 0)]
    inputs = wire.sample_inputs(calls)
    assert [c.position for c in wire.sample_calls_of(inputs)] == [5, None, 0]
    assert "sample_position" not in wire.sample_inputs([calls[1]])  # none keyed by position: nothing sent
    inputs["sample_position"] = np.array([5, -2, 0], np.int64)
    with pytest.raises(RequestError, match=r"'sample_position' must hold output positions >= 0"):
        wire.sample_calls_of(inputs)


def test_a_sampler_request_without_sequences_samples_nothing():
    empty = {"draft_token_ids": np.zeros(0, np.int64), "num_draft_tokens": np.zeros(0, np.int32)}
    assert wire.sample_calls_of(empty) == []
    outputs = wire.sample_result_outputs([], "synthetic")
    assert wire.sample_results_of(outputs) == [] and outputs["rejection_sample_method"][0] == b"synthetic"


def test_a_lone_sample_call_defaults_and_errors():
    p = torch.softmax(torch.randn(3, 7), dim=-1)  # [k + 1, vocab]
    inputs = {"draft_token_ids": np.array([1, 2]), "target_probs": p.numpy(), "seed": np.array([11], np.uint64)}
    (call,) = wire.sample_calls_of(inputs)
    assert call.draft_probs is None and call.seed == 11 and call.method is None
    assert torch.equal(call.verify.probs, p) and torch.equal(call.verify.argmax, p.argmax(-1))  # argmax derived
    with pytest.raises(RequestError, match="'target_probs' or 'target_token_ids' is required"):
        wire.sample_calls_of({"draft_token_ids": np.array([1])})
    inputs["rejection_sample_method"] = np.array([b"fastest"], dtype=np.object_)
    with pytest.raises(RequestError, match=r"'rejection_sample_method' must be one of \('strict'"):
        wire.sample_calls_of(inputs)


def test_detokenize_round_trip_and_errors():
    lists = [[1, 2, 3], [], [7]]
    assert text_wire.token_id_lists_of(text_wire.detokenize_inputs(lists)) == lists
    assert text_wire.token_id_lists_of({"token_ids": np.array([4, 5])}) == [[4, 5]]  # a lone list needs no count
    assert text_wire.texts_of({"text_output": np.array(["a".encode(), "ü".encode()], dtype=np.object_)}) == ["a", "ü"]
    with pytest.raises(RequestError, match=r"'token_ids' must be >= 0, got \[-1\]"):
        text_wire.token_id_lists_of(text_wire.detokenize_inputs([[1], [-1]]))


def test_stop_words_round_trip():
    sequences = ((1, 2), (3,), (4, 5, 6))
    assert text_wire.stop_sequences_of(text_wire.stop_words_arrays(sequences)) == sequences
    assert text_wire.stop_sequences_of(text_wire.stop_words_arrays(())) == ()


def test_a_verify_request_asks_for_the_head_layers_of_any_sequence_and_every_sequence_gets_its_rows():
    # a sequence that drafts nothing asks for no layers (SequenceState); it shares the request with one that does
    asking = VerifyRequest("a", 0, [1, 2, 3], 1, GREEDY, hidden_layers=(1, 2))
    silent = VerifyRequest("b", 0, [4, 5], 1, GREEDY)
    inputs = hidden_wire.verify_hidden_inputs([asking, silent])
    assert inputs["hidden_state_layer_ids"].tolist() == [1, 2]
    received = hidden_wire.with_hidden_layers([replace(asking, hidden_layers=()), silent], inputs)
    assert [r.hidden_layers for r in received] == [(1, 2), (1, 2)]  # the verifier computes them for both
    rows = {"hidden_states": np.arange(10, dtype=np.float32).reshape(5, 2)}  # one row per token fed
    results = hidden_wire.attach_hidden([VerifyResult(torch.tensor([0]))] * 2, rows, [3, 2])
    assert [r.hidden_states.shape[0] for r in results] == [3, 2]
    assert hidden_wire.verify_hidden_inputs([silent]) == {}
    with pytest.raises(ValueError, match="must ask for the same hidden_layers"):
        hidden_wire.verify_hidden_inputs([asking, replace(silent, hidden_layers=(3,))])


def test_a_step_beside_the_target_round_trips_as_one_call():
    """beside_wire: verify requests with their propose requests, and proposals with their results, under one frame."""
    from specdec.draft_beside_target import ProposeVerify
    from specdec_triton import beside_wire

    steps = [
        ProposeVerify(ProposeRequest("a", 5, [7], 2, SAMPLING, seed=3, hidden_position=4),
                      VerifyRequest("a", 5, [7, 0, 0], 3, SAMPLING, hidden_layers=(1, 3), sample_here=SampleHere(9))),
        ProposeVerify(None, VerifyRequest("b", 0, [1, 2, 3], 1, GREEDY, hidden_layers=(1, 3))),  # a prefill
        ProposeVerify(ProposeRequest("c", 2, [4, 5], 1, GREEDY, seed=0, hidden_position=2),
                      VerifyRequest("c", 3, [5, 0], 2, GREEDY, hidden_layers=(1, 3))),
    ]  # fmt: skip
    inputs = beside_wire.step_inputs(steps)
    assert beside_wire.is_step(inputs) and beside_wire.steps_of(inputs) == steps
    results = [(Proposal(torch.tensor([8])), VerifyResult(torch.tensor([8, 9]), sampled=SampleResult(torch.tensor([8, 9]), 1))),
               (Proposal(torch.empty(0, dtype=torch.long)), VerifyResult(torch.tensor([6]))),
               (Proposal(torch.tensor([6])), VerifyResult(torch.tensor([6, 2])))]  # fmt: skip
    outputs = beside_wire.step_outputs(results)
    asked = {name: outputs[name] for name in beside_wire.step_output_names(steps)}
    back = beside_wire.step_results_of(steps, asked)
    assert [(p.token_ids.tolist(), r.argmax.tolist()) for p, r in back] == [([8], [8, 9]), ([], [6]), ([6], [6, 2])]
    assert back[0][1].sampled.output_token_ids.tolist() == [8, 9] and back[1][1].sampled is None
    # a verify request with drafts from elsewhere (suffix decoding's) and no propose request goes as it is
    suffix = [ProposeVerify(None, VerifyRequest("d", 8, [3, 4, 5], 3, GREEDY))]
    out = beside_wire.step_outputs([(Proposal(torch.empty(0, dtype=torch.long)), VerifyResult(torch.tensor([4, 5, 1])))])
    (proposal, result), = beside_wire.step_results_of(suffix, out)
    assert proposal.token_ids.tolist() == [] and result.argmax.tolist() == [4, 5, 1]
    with pytest.raises(RuntimeError, match="returned 1 drafts for seq 'b', which asked for fewer"):
        beside_wire.step_results_of(steps, beside_wire.step_outputs([results[0], results[0], results[2]]))
    with pytest.raises(RequestError, match="input 'proposes' marks 3 sequences that draft, and 2 propose requests"):
        beside_wire.steps_of({**inputs, "proposes": np.array([True, True, True])})
