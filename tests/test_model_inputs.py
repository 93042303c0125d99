"""Every internal model answers bad direct input with INVALID_ARG naming the input, never INTERNAL.

The real ``model.py`` of each model is loaded with a stand-in for
``triton_python_backend_utils`` (metrics, logger, responses), initialized on the shipped
model pair, and fed the inputs a client calling it directly could send.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest

from specdec_triton.internal import SECRET_INPUT, boot_secret
from specdec_triton.plumbing import error_response, run_batch

REPOSITORY = __import__("pathlib").Path(__file__).resolve().parent.parent / "model_repository"
INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"


class _Metric:
    def set(self, value): ...
    def increment(self, amount): ...


class _Family:
    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name, description, kind): ...

    def Metric(self, labels):  # noqa: N802 (Triton's name)
        return _Metric()


class _TritonError:
    INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message, code):
        self.message, self.code = message, code


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.error = error


class _Logger:
    log_info = log_warn = log_error = staticmethod(lambda message: None)


@pytest.fixture(scope="module", autouse=True)
def fake_pb_utils(tmp_path_factory):
    module = types.SimpleNamespace(MetricFamily=_Family, TritonError=_TritonError, InferenceResponse=_Response,
                                   Logger=_Logger)  # fmt: skip
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = module
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECDEC_SECRET_DIR", str(tmp_path_factory.mktemp("secret")))
    yield
    patch.undo()
    if saved is None:
        del sys.modules["triton_python_backend_utils"]


def load_model(name: str):
    spec = importlib.util.spec_from_file_location(f"served_{name}", REPOSITORY / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = {"parameters": {"max_num_seqs": {"string_value": "2"}} if name in ("target_verifier", "draft_proposer")
              else {}}  # fmt: skip
    model.initialize({"model_name": name, "model_config": json.dumps(config),
                      "model_repository": str(REPOSITORY / name), "model_instance_kind": "CPU"})  # fmt: skip
    return model


def ids(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def i64(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def i32(*values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def sequence(**overrides) -> dict:
    """A valid one-sequence propose / verify request, with ``overrides`` (None: left out)."""
    inputs = {"seq_id": ids("s"), SECRET_INPUT: ids(boot_secret()), "position": i64(0), "token_ids": i64(1, 2, 3),
              **overrides}  # fmt: skip
    return {k: v for k, v in inputs.items() if v is not None}


STATEFUL_CASES = [
    ("seq_id", dict(seq_id=None)),
    ("seq_id", dict(seq_id=np.zeros(0, dtype=np.object_))),
    ("seq_id", dict(seq_id=ids("s", "s"), num_token_ids=i32(2, 1), position=i64(0, 0), num_tokens=i32(2, 2))),
    ("token_ids", dict(token_ids=None)),
    ("token_ids", dict(token_ids=i64(1, -5, 3))),
    ("token_ids", dict(token_ids=i64(1, 10**9))),
    ("position", dict(position=i64(-1))),
    ("position", dict(position=i64(7))),
    ("position", dict(position=i64(0, 0))),
    ("num_token_ids", dict(num_token_ids=i32(-3))),
    ("token_ids", dict(num_token_ids=i32(5))),
    ("temperature", dict(temperature=f32(np.nan))),
    ("temperature", dict(temperature=f32(-1.0))),
    ("top_k", dict(temperature=f32(1.0), top_k=i32(-2))),
    ("top_p", dict(temperature=f32(1.0), top_p=f32(1.5))),
    ("banned_token_ids", dict(banned_token_ids=i64(10**9), num_banned_token_ids=i32(1), num_banned_rows=i32(1),
                              num_banned_tokens=i32(1), temperature=f32(1.0))),
    (SECRET_INPUT, dict(caller_secret=None)),
    (SECRET_INPUT, dict(caller_secret=ids("guess"))),
    ("seq_id", dict(release=np.array([True]), seq_id=None)),
]
VERIFY_CASES = [("num_logits", dict(num_logits=i32(0))), ("num_logits", dict(num_logits=i32(-1))),
                ("num_logits", dict(num_logits=i32(4))), ("num_banned_rows", dict(num_banned_rows=i32(-1)))]
PROPOSE_CASES = [("num_tokens", dict(num_tokens=i32(-1))), ("num_banned_tokens", dict(num_banned_tokens=i32(-1)))]


@pytest.fixture(scope="module")
def target_verifier():
    return load_model("target_verifier")


@pytest.fixture(scope="module")
def draft_proposer():
    return load_model("draft_proposer")


def answered(handler, inputs: dict) -> _Response | None:
    """The error response a request gets (None: it succeeded), as ``answer_batch`` would make it."""
    (result,) = run_batch([inputs], handler)
    return error_response(result) if isinstance(result, Exception) else None


def assert_invalid(response, name: str) -> None:
    assert response is not None, f"bad {name!r} was accepted"
    assert response.error.code == INVALID_ARG, response.error.message
    assert name in response.error.message, response.error.message


@pytest.fixture(autouse=True)
def nothing_held_between_tests(request):
    """A case that wrongly took a slot fails its own assertion, not every case after it."""
    yield
    for name in ("target_verifier", "draft_proposer"):
        if name in request.fixturenames:
            holder = request.getfixturevalue(name)
            for seq_id in ("s", "a", "b", "c"):
                (holder.verifier if name == "target_verifier" else holder.proposer).release(seq_id)


def case_id(value) -> str:
    return value if isinstance(value, str) else ""


@pytest.mark.parametrize("name, overrides", STATEFUL_CASES + VERIFY_CASES, ids=case_id)
def test_target_verifier_refuses_bad_input_naming_it(target_verifier, name, overrides):
    assert_invalid(answered(target_verifier._serve, sequence(**overrides)), name)
    assert target_verifier.verifier.num_active_sequences == 0


@pytest.mark.parametrize("name, overrides", STATEFUL_CASES + PROPOSE_CASES, ids=case_id)
def test_draft_proposer_refuses_bad_input_naming_it(draft_proposer, name, overrides):
    assert_invalid(answered(draft_proposer._propose, sequence(**{"num_tokens": i32(2), **overrides})), name)
    assert draft_proposer.proposer.num_active_sequences == 0


def test_a_good_request_still_works_and_releases(target_verifier):
    assert answered(target_verifier._serve, sequence(num_logits=i32(2))) is None
    assert target_verifier.verifier.num_active_sequences == 1
    assert answered(target_verifier._serve, sequence(release=np.array([True]))) is None
    assert target_verifier.verifier.num_active_sequences == 0


def test_a_step_call_to_a_target_without_a_draft_beside_is_refused_naming_the_setting(target_verifier):
    for inputs in ({**sequence(num_logits=i32(1)), "proposes": np.array([False])},
                   {"describe": np.array([True]), "describe_draft": np.array([True])}):  # fmt: skip
        response = answered(target_verifier._serve, inputs)
        assert response is not None and "did not set run_with_target" in response.error.message
    assert target_verifier.verifier.num_active_sequences == 0


def test_a_full_cache_is_refused_naming_the_limit(target_verifier):
    """Three fresh sequences for two slots: the caller is told, and nothing is taken."""
    inputs = sequence(seq_id=ids("a", "b", "c"), position=i64(0, 0, 0), num_token_ids=i32(1, 1, 1))
    response = answered(target_verifier._serve, inputs)
    assert response is not None and "max_num_seqs" in response.error.message
    assert target_verifier.verifier.num_active_sequences == 0


SAMPLER_CASES = [
    ("draft_token_ids", dict(draft_token_ids=None)),
    ("draft_token_ids", dict(draft_token_ids=i64(-3, 1))),
    ("num_draft_tokens", dict(num_draft_tokens=i32(-1))),
    ("target_probs", dict(target_probs=None, target_token_ids=None)),
    ("target_probs", dict(target_probs=np.full((3, 8), np.nan, np.float32))),
    ("target_probs", dict(target_probs=-np.ones((3, 8), np.float32))),
    ("target_probs", dict(target_probs=np.zeros((3, 8), np.float32))),
    ("target_probs", dict(target_probs=np.ones((2, 8), np.float32) / 8)),
    ("draft_probs", dict(draft_probs=np.full((2, 8), np.inf, np.float32))),
    ("draft_probs", dict(draft_probs=np.ones((2, 5), np.float32) / 5)),
    ("draft_token_ids", dict(draft_token_ids=i64(1, 9))),
    ("target_token_ids", dict(target_probs=None, target_token_ids=i64(1, 2))),
    ("rejection_sample_method", dict(rejection_sample_method=ids("nope"))),
    ("seed", dict(seed=np.array([1, 2], dtype=np.uint64))),
]


@pytest.fixture(scope="module")
def rejection_sampler():
    return load_model("rejection_sampler")


def sample_request(**overrides) -> dict:
    inputs = {"draft_token_ids": i64(1, 2), "target_probs": np.ones((3, 8), np.float32) / 8, **overrides}
    return {k: v for k, v in inputs.items() if v is not None}


@pytest.mark.parametrize("name, overrides", SAMPLER_CASES, ids=case_id)
def test_rejection_sampler_refuses_bad_input_naming_it(rejection_sampler, name, overrides):
    assert_invalid(answered(lambda b: [rejection_sampler._sample(x) for x in b], sample_request(**overrides)), name)


def test_rejection_sampler_accepts_a_good_request(rejection_sampler):
    good = sample_request(seed=np.array([3], np.uint64))
    assert answered(lambda b: [rejection_sampler._sample(x) for x in b], good) is None


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tokenizer")


@pytest.fixture(scope="module")
def detokenizer():
    return load_model("detokenizer")


@pytest.mark.parametrize("name, inputs", [
    ("text_input", {}),
    ("text_input", {"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}),
    ("text_input", {"text_input": ids("a", "b")}),
    ("stop_words", {"text_input": ids("a"), "stop_words": np.array([b"\xff"], dtype=np.object_)}),
])  # fmt: skip
def test_tokenizer_refuses_bad_input_naming_it(tokenizer, name, inputs):
    assert_invalid(answered(lambda b: [tokenizer._tokenize(x) for x in b], inputs), name)


@pytest.mark.parametrize("name, inputs", [
    ("token_ids", {}),
    ("token_ids", {"token_ids": i64(-1)}),
    ("token_ids", {"token_ids": i64(10**12)}),
    ("num_token_ids", {"token_ids": i64(1, 2), "num_token_ids": i32(-1, 3)}),
])  # fmt: skip
def test_detokenizer_refuses_bad_input_naming_it(detokenizer, name, inputs):
    assert_invalid(answered(lambda b: [detokenizer._detokenize(x) for x in b], inputs), name)


def test_a_live_sequence_survives_a_slow_call_and_is_kept_by_renewals_until_its_owner_is_lost(target_verifier):
    """The idle clock: a long call of the model's own is not idleness, a renewal counts as use, and a sequence
    that neither a step nor a renewal names for longer than the timeout is reclaimed (specdec_triton.leases)."""
    leases, verifier = target_verifier.host.leases, target_verifier.verifier
    now = [0.0]
    saved = leases.clock, leases.idle_timeout_s, verifier.verify
    leases.clock, leases.idle_timeout_s = (lambda: now[0]), 20.0

    def slow_verify(requests):  # a cold compile on a busy machine: minutes inside one call
        now[0] += 100.0
        return saved[2](requests)

    try:
        verifier.verify = slow_verify
        assert answered(target_verifier._serve, sequence(seq_id=ids("a"), num_logits=i32(1))) is None
        verifier.verify = saved[2]
        assert answered(target_verifier._serve, sequence(seq_id=ids("b"), num_logits=i32(1))) is None
        assert verifier.num_active_sequences == 2  # the slow call's 100 s were not idleness of "a"
        renew = {"seq_id": ids("a", "b"), "renew": np.array([True]), SECRET_INPUT: ids(boot_secret())}
        for _ in range(3):  # 45 s in all with no step: both renewed every 15 s
            now[0] += 15.0
            assert answered(target_verifier._serve, renew) is None
        response = answered(target_verifier._serve, sequence(seq_id=ids("b"), position=i64(3), token_ids=i64(4),
                                                             num_logits=i32(1)))  # fmt: skip
        assert response is None, response.error.message
        assert verifier.num_active_sequences == 2
        now[0] += 25.0  # no renewal: the owner of "a" is gone
        assert answered(target_verifier._serve, sequence(seq_id=ids("b"), position=i64(4), token_ids=i64(5),
                                                         num_logits=i32(1))) is None  # fmt: skip
        assert verifier.num_active_sequences == 1  # "a" reclaimed; "b", named by the call, kept
        renew_b = {**renew, "seq_id": ids("zz")}  # a renewal never adds a sequence
        assert answered(target_verifier._serve, renew_b) is None and verifier.num_active_sequences == 1
    finally:
        leases.clock, leases.idle_timeout_s, verifier.verify = saved


def test_an_idle_timeout_shorter_than_three_renewals_is_refused(tmp_path):
    from specdec_triton.configs import TargetVerifierConfig
    from specdec_triton.leases import MIN_IDLE_TIMEOUT_S
    from specdec_triton.plumbing import ParameterError, Parameters

    target = str(REPOSITORY.parent / "models" / "tiny-target")
    with pytest.raises(ParameterError, match=r"target_verifier: parameter 'sequence_idle_timeout_s' must be 0 "
                                             rf"\(never reclaim\) or >= {MIN_IDLE_TIMEOUT_S:g}"):  # fmt: skip
        TargetVerifierConfig.from_parameters(Parameters({"target_model": target, "sequence_idle_timeout_s": "3"},
                                                        component="target_verifier"))  # fmt: skip
