"""TensorRT-LLM clients' inputs (specdec_triton.trtllm, request) and the orchestrator's penalties and log probs."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.penalties import Penalties
from specdec.rejection_sampler import RejectionSampler
from specdec_triton import trtllm
from specdec_triton.plumbing import RequestError
from specdec_triton.request import GenerateRequest
from local_orchestrator import codec, engine_text, make_orchestrator, make_pair, models, request, run, text_of

__all__ = ["codec", "models"]  # fixtures


def inputs(batch_dim: bool, **values) -> dict[str, np.ndarray]:
    """A request's tensors as a client builds them: [1] per scalar, or [1, 1] with TensorRT-LLM's batch dimension."""
    arrays = {}
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        array = np.array([v.encode() if isinstance(v, str) else v for v in items],
                         dtype=np.object_ if isinstance(items[0], str) else None)  # fmt: skip
        arrays[name] = array[None] if batch_dim else array
    return arrays


TRTLLM_REQUEST = dict(
    text_input="Hello", max_tokens=np.int32(8), beam_width=np.int32(1), temperature=np.float32(0.5),
    random_seed=np.uint64(3), min_length=np.int32(2), bad_words=[" x", " y"], stop_words=["."],
    repetition_penalty=np.float32(1.5), presence_penalty=np.float32(0.25), frequency_penalty=np.float32(0.5),
    return_log_probs=True, pad_id=np.int32(0), length_penalty=np.float32(1.0), num_return_sequences=np.int32(1),
    return_context_logits=False, return_generation_logits=False, num_draft_tokens=np.int32(2),
)  # fmt: skip


def test_batch_dimension_of_one_reads_the_same():
    with_batch = GenerateRequest.from_inputs(inputs(True, **TRTLLM_REQUEST))
    assert with_batch == GenerateRequest.from_inputs(inputs(False, **TRTLLM_REQUEST))
    assert with_batch.sampling.seed == 3 and with_batch.min_tokens == 2 and with_batch.num_speculative_tokens == 2
    assert with_batch.bad_words == (" x", " y") and with_batch.return_log_probs
    assert with_batch.penalties == Penalties(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.5)


def test_an_alias_that_disagrees_with_its_input_is_refused():
    with pytest.raises(RequestError, match="'random_seed' and 'seed'"):
        GenerateRequest.from_inputs(inputs(True, text_input="a", random_seed=np.uint64(1), seed=np.uint64(2)))
    same = GenerateRequest.from_inputs(inputs(True, text_input="a", min_length=np.int32(1), min_tokens=np.int32(1)))
    assert same.min_tokens == 1


@pytest.mark.parametrize("name", sorted(trtllm.UNSUPPORTED))
def test_each_unsupported_input_is_refused_by_name(name):
    with pytest.raises(RequestError, match=f"^unsupported input '{name}': "):
        GenerateRequest.from_inputs({**inputs(True, text_input="a"), name: np.zeros((1, 1), np.float32)})


@pytest.mark.parametrize("name", sorted(trtllm.ONLY_VALUE))
def test_inputs_with_one_accepted_value(name):
    allowed, _ = trtllm.ONLY_VALUE[name]
    GenerateRequest.from_inputs({**inputs(True, text_input="a"), name: np.array([[allowed]])})
    other = not allowed if isinstance(allowed, bool) else allowed + 3
    with pytest.raises(RequestError, match=f"^unsupported input '{name}' = {other}: .* only {allowed} is accepted"):
        GenerateRequest.from_inputs({**inputs(True, text_input="a"), name: np.array([[other]])})


def test_every_input_of_tensorrt_llm_has_a_status():
    """The table the docs describe: each compatibility input is an alias, one-value, no-op or refused."""
    statuses = [trtllm.ALIASES, trtllm.ONLY_VALUE, trtllm.NO_EFFECT, trtllm.UNSUPPORTED]
    assert sorted(n for table in statuses for n in table) == sorted(trtllm.COMPAT_INPUTS)


def test_bad_words_and_penalties_give_the_engines_text(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    penalties = dict(repetition_penalty=np.float32(1.5), presence_penalty=np.float32(0.5),
                     frequency_penalty=np.float32(0.25))  # fmt: skip
    for prompt in ("the quick brown fox", "def f(x):\n    return"):
        plain = run(orchestrator, request(prompt))
        generate_request = request(prompt, bad_words=["e", "o"], **penalties)
        sent = run(orchestrator, generate_request)
        bad = tuple(tuple(seq) for seq in codec.encode_stop_words(["e", "o"]))
        params = generate_request.generation_params(16, 3, codec.eos_token_ids, (), len(codec.tokenizer), bad)
        assert params.penalties.bad_words == bad
        assert text_of(sent) == engine_text(codec, models, prompt, params) != text_of(plain)
        proposer, verifier = make_pair(models, "draft_model")
        steps = generate(proposer, verifier, RejectionSampler(), codec.encode_prompt(prompt), params)
        tokens = [t for step in steps for t in step.new_token_ids]
        assert len(tokens) == 20 and not {word[0] for word in bad} & set(tokens), "bad words are tokens never emitted"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}])
def test_streamed_log_probs_add_up_to_the_single_response(codec, models, sampling):
    orchestrator, _ = make_orchestrator(codec, models)
    whole = run(orchestrator, request("Grüße aus München", return_log_probs=True, **sampling))
    pieces = run(orchestrator, request("Grüße aus München", return_log_probs=True, stream=True, **sampling))
    (out, _), = whole
    log_probs = out["output_log_probs"]  # [beams, tokens]
    assert log_probs.shape == (1, int(out["num_output_tokens"][0]))
    assert np.all(log_probs <= 0) and np.all(np.isfinite(log_probs))
    assert out["cum_log_probs"].shape == (1,) and out["cum_log_probs"][0] == pytest.approx(log_probs.sum(), rel=1e-5)
    streamed = np.concatenate([o["output_log_probs"] for o, _ in pieces], axis=1)
    assert np.allclose(streamed, log_probs, atol=1e-6)
    ids = out["output_token_ids"]  # [beams, tokens], paired with the log probs
    assert ids.shape == log_probs.shape and codec.decode(ids[0].tolist()) == text_of(whole)
    assert np.concatenate([o["output_token_ids"] for o, _ in pieces], axis=1).tolist() == ids.tolist()
    cums = [float(o["cum_log_probs"][0]) for o, _ in pieces]
    assert cums == sorted(cums, reverse=True) and cums[-1] == pytest.approx(float(out["cum_log_probs"][0]), rel=1e-5)
    quiet = run(orchestrator, request("Grüße aus München", **sampling))
    assert quiet[0][0]["output_log_probs"].shape == (1, 0) and quiet[0][0]["cum_log_probs"][0] == 0


def test_log_probs_need_a_lossless_sampler(codec, models):
    orchestrator, _ = make_orchestrator(codec, models, sampler=RejectionSampler("synthetic", 0.5))
    with pytest.raises(RequestError, match="return_log_probs"):
        run(orchestrator, request("a", return_log_probs=True))


def test_generation_params_carry_the_penalties():
    generate_request = GenerateRequest.from_inputs(inputs(False, **TRTLLM_REQUEST))
    params = generate_request.generation_params(16, 4, (0,), ((5,),), 256, ((7,), (8, 9)))
    assert params.penalties == Penalties(1.5, 0.25, 0.5, ((7,), (8, 9))) and params.return_log_probs
    assert isinstance(params, GenerationParams)
