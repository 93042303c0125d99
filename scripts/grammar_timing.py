"""Compile time and per-token mask time of a JSON schema on a tokenizer, with xgrammar (and llguidance if installed).

    python scripts/grammar_timing.py [TOKENIZER_DIR]   # default: models/tiny-target

Walks a schema-valid document token by token, filling the next-token mask before each
token, and reports the mean and the largest mask time; then the cost of one
speculative step's masks (k = 3: four rows, each after its drafts, rolled back) as
``specdec.grammar.GrammarState.masks`` makes them.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}, "required": ["name", "age", "tags", "address"]}  # fmt: skip
DOCUMENT = {"name": "bob", "age": 42, "tags": ["a", "b"], "address": {"city": "Paris"}}


def main(tokenizer_dir: str = "models/tiny-target") -> None:
    from specdec.grammar import GrammarCompiler, GrammarState
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer(json.dumps(DOCUMENT), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab)
    started = time.perf_counter()
    import xgrammar

    compiled = xgrammar.GrammarCompiler(compiler.tokenizer_info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)
    compile_ms = 1e3 * (time.perf_counter() - started)
    matcher, mask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    print(f"xgrammar: compile {compile_ms:.1f} ms; mask {1e6 * statistics.mean(times):.1f} us/token mean, "
          f"{1e6 * max(times):.0f} us max over {len(ids)} tokens (vocab {vocab})")
    state = GrammarState(compiler.compile("json_schema", json.dumps(SCHEMA)), (tokenizer.eos_token_id,))
    steps = []
    for i in range(len(ids) - 4):
        started = time.perf_counter()
        state.allowed_drafts(ids[i : i + 3])
        state.masks(ids[i : i + 3])
        steps.append(time.perf_counter() - started)
        state.accept([ids[i]])
    print(f"specdec GrammarState, k = 3: cut + 4 mask rows {1e6 * statistics.mean(steps):.0f} us/step mean")
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        return
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_ms = 1e3 * (time.perf_counter() - started)
    mask, times = llguidance.torch.allocate_token_bitmask(1, vocab), []
    for token in ids:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token)
    print(f"llguidance: compile {compile_ms:.1f} ms; mask {1e6 * statistics.mean(times):.1f} us/token mean, "
          f"{1e6 * max(times):.0f} us max over {len(ids)} tokens")


if __name__ == "__main__":
    main(*sys.argv[1:])
