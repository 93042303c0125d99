"""The tensors that cross between the served models, and their conversion to ``specdec.types``.

Both ends of every BLS call use these functions -- the orchestrator encodes, the
composing model decodes -- so the tensor names and layouts live in one place and
round-trip tests cover them. Every array is what ``pb_utils.Tensor`` takes (numpy)
without a batch dimension: for the dynamically batched models (draft_proposer,
target_verifier) ``bls.bls(batched=True)`` and ``plumbing.answer_batch`` add and
strip the one batch item per request.

A request to draft_proposer, target_verifier or rejection_sampler carries one or more
sequences, packed (:mod:`specdec_triton.packing`). The step scheduler sends every
sequence of a step as one request, so one BLS round trip and one forward serve them
all. A lone sequence may leave out the ``num_*`` and ``has_*`` inputs (the form a
client calling a model on its own writes).

A distribution that is absent (greedy ``p``, one-hot ``q``) has no rows; when no
sequence has one it travels as a ``[0, 0]`` array, so every model always returns the
same outputs.

What a model is and its limits are not data: a request with ``describe`` set gets
the model's ``ModelDescription`` (``DESCRIBE_OUTPUTS``) and nothing else, once, at
the orchestrator's start.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.rejection_sampler import METHODS
from specdec.types import (
    Proposal,
    ProposeRequest,
    SampleCall,
    SampleResult,
    SamplingParams,
    VerifyRequest,
    VerifyResult,
)
from specdec_triton.packing import (
    cut, each, each_optional_position, flat, i32, i64, one, optional_positions, required, split, stack_probs,
    unstack_probs, validated,
)  # fmt: skip
from specdec_triton.internal import SECRET_INPUT, is_authorized
from specdec_triton.grammar_wire import (
    GRAMMAR_INPUTS, GUIDE_INPUTS, grammar_inputs, guide_inputs, with_allowed_tokens, with_guide_specs,
)  # fmt: skip
from specdec_triton.penalty_wire import (
    LOG_PROB_OUTPUTS, PENALTY_INPUTS, log_mass_outputs, log_masses_of, penalties_of, penalty_inputs, top_counts_of,
    tops_of,
)  # fmt: skip
from specdec_triton.plumbing import RequestError, bytes_array, scalar, text, texts
from specdec_triton.tree_wire import (
    PROPOSAL_TREE_OUTPUTS, SAMPLE_TREE_INPUTS, SAMPLE_TREE_OUTPUTS, VERIFY_TREE_INPUTS, lists_in, lists_of, lists_out,
)  # fmt: skip
from specdec_triton.describe_wire import (  # noqa: F401  (part of this module's interface)
    DESCRIBE_OUTPUTS, DESCRIBE_SETTINGS_OUTPUTS, DESCRIBE_SOCKET_OUTPUTS, describe_inputs, description_of,
    description_outputs, is_describe, settings_outputs, socket_of, socket_outputs, with_described_settings,
)  # fmt: skip

TOKENIZER = "tokenizer"
DETOKENIZER = "detokenizer"
DRAFT_PROPOSER = "draft_proposer"
TARGET_VERIFIER = "target_verifier"
REJECTION_SAMPLER = "rejection_sampler"

SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "min_p", "logit_bias_ids", "logit_bias_values", "num_logit_bias")
BAN_INPUTS = ("banned_token_ids", "num_banned_token_ids")
PROPOSE_INPUTS = ("seq_id", "release", "renew", "describe", SECRET_INPUT, "position", "token_ids", "num_token_ids", "num_tokens",
                  *SAMPLING_INPUTS, "seed", "num_banned_tokens", *BAN_INPUTS, *GUIDE_INPUTS)  # fmt: skip
PROPOSE_OUTPUTS = ("draft_token_ids", "num_draft_tokens", "draft_probs", "has_draft_probs", *PROPOSAL_TREE_OUTPUTS)
GREEDY_PROPOSE_OUTPUTS = (*PROPOSE_OUTPUTS[:2], *PROPOSAL_TREE_OUTPUTS)  # what greedy sequences need back: no q
VERIFY_INPUTS = ("seq_id", "release", "renew", "describe", SECRET_INPUT, "position", "token_ids", "num_token_ids", "num_logits",
                 *SAMPLING_INPUTS, "num_banned_rows", *BAN_INPUTS, *PENALTY_INPUTS, *VERIFY_TREE_INPUTS,
                 *GRAMMAR_INPUTS)  # fmt: skip
VERIFY_OUTPUTS = ("target_token_ids", "target_probs", "has_target_probs")  # + LOG_PROB_OUTPUTS when asked
DECLARED_VERIFY_OUTPUTS = VERIFY_OUTPUTS + LOG_PROB_OUTPUTS  # what target_verifier answers (describe aside)
GREEDY_VERIFY_OUTPUTS = VERIFY_OUTPUTS[:1]  # greedy targets: the argmax alone
SAMPLE_INPUTS = ("describe", "draft_token_ids", "num_draft_tokens", "draft_probs", "has_draft_probs", "target_probs",
                 "has_target_probs", "target_token_ids", "seed", "sample_position", "rejection_sample_method",
                 *SAMPLE_TREE_INPUTS)  # fmt: skip
SAMPLE_OUTPUTS = ("output_token_ids", "num_accepted", *SAMPLE_TREE_OUTPUTS, "rejection_sample_method")

# --- per-sequence state: seq_id, release and renew ---------------------------------------------


def secret_input(secret: str) -> dict[str, np.ndarray]:
    """What the orchestrator adds to each request to a stateful model (``specdec_triton.internal``)."""
    return {SECRET_INPUT: bytes_array([secret])}


def check_caller(inputs: Mapping[str, np.ndarray], secret: str, model: str) -> None:
    """Refuse a request to a stateful model that does not carry this server's secret."""
    if not is_authorized(text(inputs, SECRET_INPUT), secret):
        raise RequestError(
            f"{model} is internal to speculative_decoding: send requests to ensemble or speculative_decoding "
            f"(a direct {model} request needs input '{SECRET_INPUT}', this server's per-boot secret)"
        )


def release_inputs(seq_ids: Sequence[str]) -> dict[str, np.ndarray]:
    return {"seq_id": bytes_array(list(seq_ids)), "release": one(True, np.bool_)}


def renew_inputs(seq_ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The sequences the orchestrator's requests still hold: none of them is idle, whatever its last step."""
    return {"seq_id": bytes_array(list(seq_ids)), "renew": one(True, np.bool_)}


def response_inputs(responses: Sequence[Sequence[int] | None]) -> dict[str, np.ndarray]:
    """With a release to the proposer: each sequence's output if its request completed, else nothing."""
    return {"token_ids": flat([r or () for r in responses]), "num_token_ids": i32([len(r or ()) for r in responses])}


def responses_of(inputs: Mapping[str, np.ndarray]) -> list[list[int]]:
    """One per released seq_id: its response (empty when it did not complete, or none was sent)."""
    count = len(seq_ids_of(inputs))
    return split(inputs, "token_ids", "num_token_ids", count) if "token_ids" in inputs else [[]] * count


def seq_ids_of(inputs: Mapping[str, np.ndarray]) -> list[str]:
    seq_ids = texts(inputs, "seq_id")
    if not seq_ids:
        raise RequestError("input 'seq_id' is required and must name at least one sequence")
    return seq_ids


def is_release(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, "release", bool, False)


def is_renew(inputs: Mapping[str, np.ndarray]) -> bool:
    return scalar(inputs, "renew", bool, False)


def _is_default(sampling: SamplingParams) -> bool:
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (0.0, 0, 1.0, 0.0)


def _sampling_inputs(sampling: Sequence[SamplingParams]) -> dict[str, np.ndarray]:
    """The sampling settings, left out when every sequence decodes greedily with no top-k / top-p / min-p;
    the logit bias, left out when no sequence has one.

    Absent inputs read as those defaults, and every tensor a BLS request carries costs
    time on the step's critical path.
    """
    inputs = {}
    if any(s.logit_bias for s in sampling):  # every sequence's (id, bias) pairs, concatenated, and their counts
        inputs = {
            "logit_bias_ids": flat([[t for t, _ in s.logit_bias] for s in sampling]),
            "logit_bias_values": np.array([b for s in sampling for _, b in s.logit_bias], np.float32),
            "num_logit_bias": i32([len(s.logit_bias) for s in sampling]),  # [S]
        }
    if all(_is_default(s) for s in sampling):
        return inputs
    return {
        "temperature": np.array([s.temperature for s in sampling], dtype=np.float32),
        "top_k": i32([s.top_k for s in sampling]),
        "top_p": np.array([s.top_p for s in sampling], dtype=np.float32),
        "min_p": np.array([s.min_p for s in sampling], dtype=np.float32),
        **inputs,
    }


def _sampling_of(inputs: Mapping[str, np.ndarray], count: int) -> list[SamplingParams]:
    temperature = each(inputs, "temperature", count, float, 0.0)
    top_k = each(inputs, "top_k", count, int, 0)
    top_p = each(inputs, "top_p", count, float, 1.0)
    min_p = each(inputs, "min_p", count, float, 0.0)
    bias = _logit_bias_of(inputs, count)
    return validated([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, logit_bias=b)
                      for t, k, p, m, b in zip(temperature, top_k, top_p, min_p, bias)])  # fmt: skip


def _logit_bias_of(inputs: Mapping[str, np.ndarray], count: int) -> list[tuple[tuple[int, float], ...]]:
    if "num_logit_bias" not in inputs:
        return [()] * count
    ids = split(inputs, "logit_bias_ids", "num_logit_bias", count)
    values = np.asarray(inputs.get("logit_bias_values", np.zeros(0, np.float32)), np.float32).reshape(-1).tolist()
    if len(values) != sum(len(i) for i in ids):
        raise RequestError(f"input 'logit_bias_values' holds {len(values)} values for {sum(map(len, ids))} ids")
    return [tuple(zip(seq_ids, seq_values)) for seq_ids, seq_values in zip(ids, cut(values, [len(i) for i in ids]))]


def _ban_inputs(count_name: str, counts: Sequence[int], banned: Sequence[tuple[int, ...]]) -> dict[str, np.ndarray]:
    """min_tokens: how many positions (drafts or target rows) may not emit each sequence's banned ids."""
    if not any(counts):
        return {}
    banned = [ids if n else () for n, ids in zip(counts, banned)]
    lengths = i32([len(ids) for ids in banned])
    return {count_name: i32(counts), "banned_token_ids": flat(banned), "num_banned_token_ids": lengths}


def _bans_of(inputs: Mapping[str, np.ndarray], count_name: str, count: int) -> list[tuple[int, tuple[int, ...]]]:
    counts = each(inputs, count_name, count, int, 0)
    if any(n < 0 for n in counts):
        raise RequestError(f"input '{count_name}' must not be negative, got {counts}")
    if "banned_token_ids" not in inputs:
        return [(n, ()) for n in counts]
    banned = split(inputs, "banned_token_ids", "num_banned_token_ids", count)
    return [(n, tuple(ids)) for n, ids in zip(counts, banned)]


# --- draft_proposer ----------------------------------------------------------------------------


def propose_inputs(requests: Sequence[ProposeRequest]) -> dict[str, np.ndarray]:
    return {
        "seq_id": bytes_array([r.seq_id for r in requests]),  # [S]
        "position": i64([r.position for r in requests]),  # [S]
        "token_ids": flat([r.token_ids for r in requests]),  # tokens the proposer has not been sent, concatenated
        "num_token_ids": i32([len(r.token_ids) for r in requests]),  # [S]
        "num_tokens": i32([r.num_tokens for r in requests]),  # [S]: k
        **_sampling_inputs([r.sampling for r in requests]),
        # greedy drafts draw nothing, so a request of greedy sequences leaves the seeds out
        **({} if all(r.sampling.greedy for r in requests) else {"seed": np.array([r.seed for r in requests], np.uint64)}),
        **_ban_inputs("num_banned_tokens", [r.num_banned_tokens for r in requests],
                      [r.banned_token_ids for r in requests]),  # fmt: skip
        **guide_inputs(requests),  # a sequence's first request, with a grammar (grammar_wire)
    }


def propose_requests_of(inputs: Mapping[str, np.ndarray]) -> list[ProposeRequest]:
    seq_ids = seq_ids_of(inputs)
    count = len(seq_ids)
    required(inputs, "token_ids")
    fields = zip(
        seq_ids,
        each(inputs, "position", count, int, 0),
        split(inputs, "token_ids", "num_token_ids", count),
        each(inputs, "num_tokens", count, int, 0),
        _sampling_of(inputs, count),
        each(inputs, "seed", count, int, 0),
        _bans_of(inputs, "num_banned_tokens", count),
    )
    return with_guide_specs([
        ProposeRequest(seq_id, position, token_ids, num_tokens, sampling, seed, num_banned, banned)
        for seq_id, position, token_ids, num_tokens, sampling, seed, (num_banned, banned) in fields
    ], inputs)  # fmt: skip


def proposal_outputs(proposals: Sequence[Proposal]) -> dict[str, np.ndarray]:
    """One proposal per sequence of the request (none for a release)."""
    probs, has_probs = stack_probs([p.probs for p in proposals])
    return {
        "draft_token_ids": flat([p.token_ids.cpu().tolist() for p in proposals]),  # [sum of k'], k' <= k
        "num_draft_tokens": i32([len(p.token_ids) for p in proposals]),  # [S]: k' of each sequence
        "draft_probs": probs,  # [sum of k' over has_draft_probs, vocab] q; one-hot q has no rows
        "has_draft_probs": has_probs,  # [S]
        **lists_out("draft_parents", [p.parents for p in proposals]),  # trees' parents (tree_wire)
    }


def proposals_of(outputs: Mapping[str, np.ndarray]) -> list[Proposal]:
    count = np.asarray(outputs["num_draft_tokens"]).size
    token_ids = split(outputs, "draft_token_ids", "num_draft_tokens", count)
    probs = unstack_probs(outputs, "draft_probs", [len(ids) for ids in token_ids])
    parents = lists_of(outputs, "draft_parents", count)
    return [Proposal(token_ids=torch.tensor(ids, dtype=torch.long), probs=q, parents=tree)
            for ids, q, tree in zip(token_ids, probs, parents)]  # fmt: skip


# --- target_verifier ---------------------------------------------------------------------------


def verify_inputs(requests: Sequence[VerifyRequest]) -> dict[str, np.ndarray]:
    return {
        "seq_id": bytes_array([r.seq_id for r in requests]),  # [S]
        "position": i64([r.position for r in requests]),  # [S]
        "token_ids": flat([r.token_ids for r in requests]),  # tokens not yet in the target's cache, concatenated
        "num_token_ids": i32([len(r.token_ids) for r in requests]),  # [S]
        "num_logits": i32([r.num_logits for r in requests]),  # [S]: k + 1
        **_sampling_inputs([r.sampling for r in requests]),
        **_ban_inputs("num_banned_rows", [r.num_banned_rows for r in requests],
                      [r.banned_token_ids for r in requests]),  # fmt: skip
        **penalty_inputs(requests),
        **lists_in("tree_parents", [r.tree_parents for r in requests]),  # tree_wire
        **lists_in("accepted_path", [r.accepted_path or None for r in requests]),
        **grammar_inputs(requests),
    }


def verify_requests_of(inputs: Mapping[str, np.ndarray]) -> list[VerifyRequest]:
    seq_ids = seq_ids_of(inputs)
    count = len(seq_ids)
    required(inputs, "token_ids")
    fields = zip(
        seq_ids,
        each(inputs, "position", count, int, 0),
        split(inputs, "token_ids", "num_token_ids", count),
        each(inputs, "num_logits", count, int, 1),
        _sampling_of(inputs, count),
        _bans_of(inputs, "num_banned_rows", count),
        penalties_of(inputs, count),
    )
    requests = with_allowed_tokens([
        VerifyRequest(seq_id, position, token_ids, num_logits, sampling, num_banned, banned, *penalties)
        for seq_id, position, token_ids, num_logits, sampling, (num_banned, banned), penalties in fields
    ], inputs)  # fmt: skip
    if "num_top_log_probs" in inputs:
        requests = [replace(r, num_top_log_probs=n) for r, n in zip(requests, top_counts_of(inputs, count))]
    trees, paths = lists_of(inputs, "tree_parents", count), lists_of(inputs, "accepted_path", count)
    if not any(trees) and not any(paths):
        return requests
    return [replace(r, tree_parents=tree, accepted_path=path or ()) for r, tree, path in zip(requests, trees, paths)]


def verify_outputs(results: Sequence[VerifyResult]) -> dict[str, np.ndarray]:
    """One result per sequence (none for a release)."""
    probs, has_probs = stack_probs([r.probs for r in results])
    return {
        "target_token_ids": flat([r.argmax.cpu().tolist() for r in results]),  # [sum of num_logits] argmax
        "target_probs": probs,  # [sum of num_logits over has_target_probs, vocab] p; greedy has no rows
        "has_target_probs": has_probs,  # [S]
        **log_mass_outputs(results),  # LOG_PROB_OUTPUTS
    }


def verify_results_of(outputs: Mapping[str, np.ndarray], num_logits: Sequence[int]) -> list[VerifyResult]:
    """The results of a request whose sequences asked for ``num_logits`` rows each."""
    argmax = split(outputs, "target_token_ids", list(num_logits), len(num_logits))
    probs = unstack_probs(outputs, "target_probs", list(num_logits))
    masses, tops = log_masses_of(outputs, num_logits), tops_of(outputs, num_logits)
    return [VerifyResult(torch.tensor(ids, dtype=torch.long), p, m, top_token_ids=t[0], top_log_probs=t[1])
            for ids, p, m, t in zip(argmax, probs, masses, tops)]  # fmt: skip


# --- rejection_sampler -------------------------------------------------------------------------


def sample_inputs(calls: Sequence[SampleCall]) -> dict[str, np.ndarray]:
    """One rejection_sampler request for ``calls``; their ``method`` must agree (it is one per request)."""
    methods = {call.method for call in calls}
    if len(methods) > 1:
        raise ValueError(f"one rejection_sampler request takes one method, got {sorted(map(str, methods))}")
    draft_probs, has_draft_probs = stack_probs([call.draft_probs for call in calls])
    target_probs, has_target_probs = stack_probs([call.verify.probs for call in calls])
    inputs = {
        "draft_token_ids": flat([call.draft_token_ids.cpu().tolist() for call in calls]),  # [sum of k]
        "num_draft_tokens": i32([len(call.draft_token_ids) for call in calls]),  # [S]
        "target_token_ids": flat([call.verify.argmax.cpu().tolist() for call in calls]),  # [sum of k + 1]
        "seed": np.array([call.seed for call in calls], dtype=np.uint64),
    }
    if any(call.position is not None for call in calls):  # [S]: output index of row 0
        inputs["sample_position"] = optional_positions(call.position for call in calls)
    if has_draft_probs.any():
        inputs.update(draft_probs=draft_probs, has_draft_probs=has_draft_probs)
    if has_target_probs.any():
        inputs.update(target_probs=target_probs, has_target_probs=has_target_probs)
    inputs.update(lists_in("draft_parents", [call.parents for call in calls]))  # tree_wire
    (method,) = methods
    if method is not None:
        inputs["rejection_sample_method"] = bytes_array([method])
    return inputs


def sample_calls_of(inputs: Mapping[str, np.ndarray]) -> list[SampleCall]:
    required(inputs, "draft_token_ids")
    count = np.asarray(inputs["num_draft_tokens"]).size if "num_draft_tokens" in inputs else 1
    drafts = split(inputs, "draft_token_ids", "num_draft_tokens", count)
    rows = [len(d) + 1 for d in drafts]
    target_probs = unstack_probs(inputs, "target_probs", rows)
    if "target_token_ids" in inputs:
        argmax = [torch.tensor(ids, dtype=torch.long) for ids in split(inputs, "target_token_ids", rows, count)]
    elif all(p is not None for p in target_probs):
        argmax = [p.argmax(dim=-1) for p in target_probs]  # [k + 1] each
    else:
        raise RequestError("one of the inputs 'target_probs' or 'target_token_ids' is required")
    method = text(inputs, "rejection_sample_method")
    if method is not None and method not in METHODS:
        raise RequestError(f"input 'rejection_sample_method' must be one of {METHODS}, got {method!r}")
    positions = each_optional_position(inputs, "sample_position", count)
    fields = zip(drafts, unstack_probs(inputs, "draft_probs", [len(d) for d in drafts]), argmax, target_probs,
                 each(inputs, "seed", count, int, None), positions, lists_of(inputs, "draft_parents", count))  # fmt: skip
    return [
        SampleCall(torch.tensor(d, dtype=torch.long), q, VerifyResult(argmax=a, probs=p), seed, method, position, tree)
        for d, q, a, p, seed, position, tree in fields
    ]


def sample_result_outputs(results: Sequence[SampleResult], configured_method: str) -> dict[str, np.ndarray]:
    """Every response also names the sampler's configured method (what a request without an override gets)."""
    return {
        "output_token_ids": flat([r.output_token_ids.cpu().tolist() for r in results]),  # [sum of accepted + 1]
        "num_accepted": i32([r.num_accepted for r in results]),  # [S]
        **lists_out("accepted_nodes", [r.accepted_nodes for r in results]),  # a tree's path (tree_wire)
        "rejection_sample_method": bytes_array([configured_method]),  # [1]
    }


def sample_results_of(outputs: Mapping[str, np.ndarray]) -> list[SampleResult]:
    accepted = i32(outputs["num_accepted"]).tolist()
    tokens = split(outputs, "output_token_ids", [n + 1 for n in accepted], len(accepted))
    paths = lists_of(outputs, "accepted_nodes", len(accepted))
    return [SampleResult(torch.tensor(ids, dtype=torch.long), n, accepted_nodes=path)
            for ids, n, path in zip(tokens, accepted, paths)]  # fmt: skip
