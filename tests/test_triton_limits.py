"""Per-client cap on requests in flight (``max_sequences_per_client``): one client cannot hold every slot."""
from __future__ import annotations

import asyncio
import dataclasses

from local_orchestrator import (  # noqa: F401 (codec, models: fixtures)
    PROMPTS, codec, make_orchestrator, models, request, text_of,
)

from specdec_triton.plumbing import ServingError


def capped(codec, models, limit: int):
    orchestrator, stages = make_orchestrator(codec, models)
    orchestrator.config = dataclasses.replace(orchestrator.config, max_sequences_per_client=limit)
    return orchestrator, stages


def test_a_client_past_its_cap_is_refused_while_others_run(codec, models):
    orchestrator, _ = capped(codec, models, 2)

    async def scenario():
        def one(prompt, client):
            sent = []
            coroutine = orchestrator.generate(request(prompt, max_tokens=12), lambda out, final: sent.append((out, final)),
                                              lambda: False, client)  # fmt: skip
            return asyncio.ensure_future(coroutine), sent

        tasks = [one(PROMPTS[i % len(PROMPTS)], client) for i, client in enumerate(["a", "a", "a", "b", None])]
        outcomes = await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)
        return outcomes, [sent for _, sent in tasks]

    outcomes, sent = asyncio.run(scenario())
    assert isinstance(outcomes[2], ServingError) and "client 'a': 2 requests already in flight" in str(outcomes[2])
    assert [o is None for o in outcomes] == [True, True, False, True, True]
    assert all(text_of(s) for i, s in enumerate(sent) if i != 2)
    assert not orchestrator._per_client  # every count returned


def test_a_finished_request_frees_its_clients_place(codec, models):
    orchestrator, _ = capped(codec, models, 1)
    for prompt in PROMPTS[:3]:  # one after another: never two at once
        sent = []
        asyncio.run(orchestrator.generate(request(prompt, max_tokens=4), lambda out, final: sent.append((out, final)),
                                          lambda: False, "a"))  # fmt: skip
        assert sent[-1][1]


def test_no_cap_by_default(codec, models):
    orchestrator, _ = make_orchestrator(codec, models)
    assert orchestrator.config.max_sequences_per_client == 0
