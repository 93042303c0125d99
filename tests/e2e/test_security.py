"""Through a real server: no client can open, overwrite or free sequences in the stateful models.

The hostile calls come from the public gRPC port, as a client that knows the
repository's model names would send them, while public requests decode beside them.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from client.generate import generate_grpc
from test_components import infer
from test_concurrency import PROMPTS, wait_until_idle
from tritonclient.utils import InferenceServerException

from specdec_triton.internal import secret_path

pytestmark = pytest.mark.server

MAX_TOKENS = 32


def call(server, model: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
    return infer(server, model, batched=True, **inputs)


def ids(*names: str) -> np.ndarray:
    return np.array([name.encode() for name in names], dtype=np.object_)


def hostile_calls(server, seq_ids: list[str], secret: str | None) -> list[str]:
    """Take every slot, then overwrite and free sequences; the error message of each refused call."""
    extra = {} if secret is None else {"caller_secret": ids(secret)}
    count = len(seq_ids)
    attempts = [
        ("target_verifier", dict(seq_id=ids(*seq_ids), position=np.zeros(count, np.int64),
                                 token_ids=np.ones(count, np.int64), num_token_ids=np.ones(count, np.int32),
                                 num_logits=np.ones(count, np.int32))),
        ("draft_proposer", dict(seq_id=ids(*seq_ids), position=np.zeros(count, np.int64),
                                token_ids=np.ones(count, np.int64), num_token_ids=np.ones(count, np.int32),
                                num_tokens=np.ones(count, np.int32))),
        ("target_verifier", dict(seq_id=ids(*seq_ids), release=np.array([True]))),
        ("draft_proposer", dict(seq_id=ids(*seq_ids), release=np.array([True]))),
    ]  # fmt: skip
    refused = []
    for model, inputs in attempts:
        try:
            call(server, model, **inputs, **extra)
        except InferenceServerException as err:
            refused.append(str(err))
    return refused


def test_direct_calls_to_the_stateful_models_are_refused_while_public_traffic_decodes(server, reference):
    params = {"stream": True, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    texts: list[str | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        texts[i] = generate_grpc(server.grpc_url, "ensemble", PROMPTS[i], params).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    refused = []
    for attempt in range(3):  # fresh ids for every slot, then a guessed secret
        refused += hostile_calls(server, [f"evil-{attempt}-{i}" for i in range(8)], None)
        refused += hostile_calls(server, [f"evil-{attempt}-{i}" for i in range(8)], "00" * 32)
    for thread in threads:
        thread.join()
    assert len(refused) == 24 and all("is internal to speculative_decoding" in message for message in refused)
    failures = [f for f in (reference.greedy_mismatch(p, t, MAX_TOKENS) for p, t in zip(PROMPTS, texts)) if f]
    assert not failures, "\n".join(failures)
    wait_until_idle(server)


def test_the_servers_own_secret_opens_them(server):
    """The orchestrator's way in works for a caller that can read the secret file (the server's own user)."""
    secret = secret_path(server.pid).read_text().strip()
    out = call(server, "target_verifier", seq_id=ids("probe"), position=np.zeros(1, np.int64),
               token_ids=np.ones(3, np.int64), num_logits=np.ones(1, np.int32), caller_secret=ids(secret))  # fmt: skip
    assert out["target_token_ids"].size == 1
    call(server, "target_verifier", seq_id=ids("probe"), release=np.array([True]), caller_secret=ids(secret))
    described = call(server, "target_verifier", describe=np.array([True]))  # no secret needed to describe
    assert described["describe_method"].reshape(-1)[0] == b"target"
    wait_until_idle(server)
