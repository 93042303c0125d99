"""``specdec_triton.bls`` against a stand-in for ``triton_python_backend_utils``: what a request carries, what comes back."""
from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from specdec_triton.bls import BlsError, bls, bls_blocking


class _Error:
    def __init__(self, message, code):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class _Response:
    def __init__(self, outputs=None, error=None):
        self.outputs, self._error = outputs or {}, error

    def has_error(self):
        return self._error is not None

    def output_tensors(self):
        return list(self.outputs.values())

    def error(self):
        return self._error


class _Tensor:
    def __init__(self, name, array):
        self._name, self.array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self.array


@pytest.fixture
def triton(monkeypatch):
    """A stand-in backend whose models answer every input doubled, or with ``error`` when set."""
    sent = []
    state = types.SimpleNamespace(error=None, sent=sent, drop=())  # drop: outputs the model leaves out

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names):
            self.model_name, self.inputs, self.names = model_name, inputs, requested_output_names

        def exec(self):
            sent.append(("exec", self.model_name, {t.name(): t.array for t in self.inputs}, self.names))
            if state.error is not None:
                return _Response(error=state.error)
            return _Response({name: _Tensor(name, self.inputs[0].array * 2) for name in self.names
                              if name not in state.drop})  # fmt: skip

        async def async_exec(self):
            response = self.exec()
            sent[-1] = ("async_exec", *sent[-1][1:])
            return response

    module = types.SimpleNamespace(InferenceRequest=InferenceRequest, Tensor=_Tensor)
    monkeypatch.setitem(__import__("sys").modules, "triton_python_backend_utils", module)
    return state


def test_async_request_carries_its_inputs_and_returns_the_named_outputs(triton):
    out = asyncio.run(bls("target_verifier", {"a": np.array([1, 2])}, ["x", "y"]))
    assert sorted(out) == ["x", "y"] and out["x"].tolist() == [2, 4]
    [(how, model, inputs, names)] = triton.sent
    assert (how, model, names) == ("async_exec", "target_verifier", ["x", "y"])
    assert inputs["a"].tolist() == [1, 2]


def test_a_batched_request_is_one_batch_item_each_way(triton):
    out = asyncio.run(bls("tokenizer", {"a": np.array([1, 2])}, ["x"], batched=True))
    assert triton.sent[0][2]["a"].shape == (1, 2)  # a batch of one
    assert out["x"].tolist() == [2, 4]  # and the batch dimension taken off again


def test_blocking_request_waits_for_the_same_answer(triton):
    out = bls_blocking("rejection_sampler", {"a": np.array([3])}, ["x"])
    assert out["x"].tolist() == [6] and triton.sent[0][0] == "exec"


@pytest.mark.parametrize("blocking", [False, True])
def test_an_error_answer_raises_naming_the_model_with_its_code(triton, blocking):
    triton.error = _Error("seq 's': position 9 beyond the cached 4 tokens", "INVALID_ARG")
    with pytest.raises(BlsError, match="^rejection_sampler: seq 's': position 9") as caught:
        if blocking:
            bls_blocking("rejection_sampler", {"a": np.array([3])}, ["x"])
        else:
            asyncio.run(bls("rejection_sampler", {"a": np.array([3])}, ["x"]))
    assert caught.value.code == "INVALID_ARG"


def test_a_response_without_a_requested_output_is_named(triton):
    triton.drop = ("y",)
    with pytest.raises(RuntimeError, match=r"^draft_proposer: the response lacks the requested output\(s\) \['y'\]"):
        bls_blocking("draft_proposer", {"a": np.array([3])}, ["x", "y"])
