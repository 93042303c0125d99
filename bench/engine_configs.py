"""The configurations ``scripts/benchmark_engine.py`` compares, as its ``--configs`` spells them.

``k0`` or ``METHOD:K``, the method with at most one of ``+follow`` (k follows acceptance),
``+tree`` (a static or dynamic tree), ``+pard`` (``parallel_drafting``) or ``+suffix``
(suffix decoding in front), then optionally ``+json``: every request of the configuration
constrained by the run's guide (a JSON schema, ``--guide``), as a request sending
``guided_decoding_guide_type: json_schema`` is (``specdec.grammar``). A ``+json``
configuration is compared with ``k0+json``: greedy under a grammar is the constrained
target's argmax, so its output must equal constrained k = 0's, not plain k = 0's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.repository import SUFFIX_FIRST
from specdec.heads import HEAD_METHODS
from specdec.methods import METHODS as DECLARED
from specdec.proposers.model_free import MODEL_FREE_METHODS

K0 = "k0"
MODEL_METHODS = ("draft_model", *HEAD_METHODS)
METHODS = (*MODEL_METHODS, *MODEL_FREE_METHODS, *(m + SUFFIX_FIRST for m in MODEL_METHODS))
FOLLOW = "+follow"  # a configuration whose k follows each sequence's acceptance, under K
TREE = "+tree"  # drafting --token-tree cut to K nodes instead of a chain of K
PARALLEL = "+pard"  # K tokens drafted in one forward (parallel_drafting): a PARD draft model, a P-EAGLE head
PARALLEL_METHODS = tuple(name for name, method in DECLARED.items() if method.parallel_drafting)
GUIDED = "+json"  # every request under the run's JSON schema (structured output)

# The guide when ``--guide`` names none: a record whose keys, booleans and enum values the
# grammar forces (tokens a drafter may still miss) and whose free string and integer
# array let the target write: no maxLength and no maxItems, so an output runs on to
# max_tokens as an unconstrained one does, and tokens/s compare outputs of the same length.
DEFAULT_GUIDE = {"type": "object", "properties": {
    "title": {"type": "string"}, "draft": {"type": "boolean"}, "kind": {"enum": ["note", "code", "story"]},
    "body": {"type": "string"}, "lines": {"type": "array", "items": {"type": "integer", "minimum": 0}},
}, "required": ["title", "draft", "kind", "body", "lines"], "additionalProperties": False}  # fmt: skip


def parse_configs(text: str) -> list[tuple[str, int]]:
    """``k0,draft_model:4,eagle3+json:4`` -> [("k0", 0), ("draft_model", 4), ("k0+json", 0), ("eagle3+json", 4)].

    ``k0`` is added where missing, and ``k0+json`` beside the first ``+json`` configuration:
    every ratio and every output check is against the k = 0 under the same guide.
    """
    configs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if unguided(item) == K0:
            configs.append((item, 0))
            continue
        method, _, k = item.partition(":")
        if base(method) not in METHODS or not k.isdigit() or int(k) < 1:
            raise argparse.ArgumentTypeError(f"config {item!r}: expected k0, METHOD:K, METHOD{FOLLOW}:K, "
                                             f"METHOD{TREE}:K or METHOD{PARALLEL}:K with METHOD in {METHODS}, "
                                             f"K >= 1, each optionally followed by {GUIDED}")  # fmt: skip
        if PARALLEL in method and base(method) not in PARALLEL_METHODS:
            raise argparse.ArgumentTypeError(f"config {item!r}: {PARALLEL} (parallel_drafting) is for "
                                             f"{' and '.join(PARALLEL_METHODS)}")  # fmt: skip
        configs.append((method, int(k)))
    if (K0, 0) not in configs:
        configs.insert(0, (K0, 0))
    guided_at = next((i for i, (method, _) in enumerate(configs) if guided(method)), None)
    if guided_at is not None and (K0 + GUIDED, 0) not in configs:
        configs.insert(guided_at, (K0 + GUIDED, 0))
    return configs


def guided(method: str) -> bool:
    """Whether the configuration constrains every request by the guide: ``eagle3+json``, ``k0+json``."""
    return method.endswith(GUIDED)


def unguided(method: str) -> str:
    """The configuration without its guide: ``eagle3+tree+json`` -> ``eagle3+tree``."""
    return method.removesuffix(GUIDED)


def base(method: str) -> str:
    """The method a configuration runs, without its ``+json``, ``+follow``, ``+pard`` or ``+tree``."""
    return unguided(method).removesuffix(FOLLOW).removesuffix(PARALLEL).removesuffix(TREE)


def reference(method: str) -> str:
    """The configuration whose outputs greedy ``method`` must equal: k0 under the same guide, or none."""
    return K0 + GUIDED if guided(method) else K0


def read_guide(path: Path | None) -> str:
    """The JSON schema of ``--guide`` (``DEFAULT_GUIDE`` when None), as the text a request would send."""
    if path is None:
        return json.dumps(DEFAULT_GUIDE)
    text = Path(path).read_text()
    try:
        json.loads(text)  # named here, before a model loads
    except json.JSONDecodeError as err:
        raise ValueError(f"--guide {path}: not a JSON schema ({err})") from None
    return text
