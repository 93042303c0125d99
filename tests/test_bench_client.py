"""bench/client.py: request tensors."""
from __future__ import annotations

import pytest

from bench.client import Job, build_inputs
from bench.workload import Prompt


def test_client_builds_request_tensors_in_the_model_datatypes():
    job = Job(Prompt("a.py:1", "x = 1\n", [5, 6, 7]), max_tokens=12, num_speculative_tokens=0, ignore_eos=True)
    datatypes = {"text_input": "BYTES", "stream": "BOOL", "max_tokens": "INT32", "min_tokens": "INT32",
                 "num_speculative_tokens": "INT32", "temperature": "FP32"}
    tensors = {t.name(): t for t in build_inputs(job, datatypes)}
    assert sorted(tensors) == sorted(set(datatypes) - {"temperature"})
    assert tensors["text_input"].datatype() == "BYTES" and tensors["text_input"].shape() == [1]
    assert tensors["stream"].datatype() == "BOOL"
    assert tensors["min_tokens"].shape() == [1] and tensors["num_speculative_tokens"].datatype() == "INT32"
    no_k = Job(job.prompt, 12, None, ignore_eos=False)
    assert sorted(t.name() for t in build_inputs(no_k, datatypes)) == ["max_tokens", "stream", "text_input"]
    with pytest.raises(KeyError, match="no input 'min_tokens'"):
        build_inputs(job, {k: v for k, v in datatypes.items() if k != "min_tokens"})


def test_a_sampled_job_sends_its_temperature_and_a_seed_from_its_prompt():
    prompt = Prompt("a.py:1", "x = 1\n", [5, 6, 7])
    datatypes = {"text_input": "BYTES", "stream": "BOOL", "max_tokens": "INT32", "temperature": "FP32", "seed": "UINT64"}
    sampled = {t.name(): t for t in build_inputs(Job(prompt, 12, None, False, temperature=0.8), datatypes)}
    assert sampled["temperature"].datatype() == "FP32" and sampled["seed"].datatype() == "UINT64"
    again = {t.name(): t for t in build_inputs(Job(prompt, 12, None, False, temperature=0.8), datatypes)}
    assert sampled["seed"]._get_content() == again["seed"]._get_content()  # the same prompt, the same seed
    assert "seed" not in {t.name() for t in build_inputs(Job(prompt, 12, None, False), datatypes)}
