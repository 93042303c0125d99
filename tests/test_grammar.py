"""Structured output under speculation (``specdec.grammar``): lossless with respect to the constrained target.

Greedy: the shipped pair with k drafts equals k = 0 with the same guide, and HF
``generate`` with xgrammar's logits processor. Every output that ends with ``stop``
parses and validates. Sampled: a chi-square test of the first tokens against the
masked target's exact joint (the method of ``test_sampled_losslessness``).
"""
from __future__ import annotations

import copy
import json
import re
from collections import Counter

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from specdec.engine import GenerationParams, SequenceState
from specdec.generate import generate
from specdec.grammar import GrammarCompiler, GrammarError, GrammarState, apply_allowed, cut_proposal
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import process_logits
from specdec.tree import ROOT
from specdec.types import Proposal, SamplingParams
from specdec.verifier import TargetVerifier

xgrammar = pytest.importorskip("xgrammar")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]},
    }, "required": ["name", "address"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}, "required": ["tags"]},
    "bounded_integer": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["age"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
                "required": ["code"]},
}  # fmt: skip
PROMPTS = ["Person as JSON: ", '{"id": 1, "name": "alpha"} and another: ', "x"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def compiler(shipped_pair):
    return GrammarCompiler(shipped_pair.tokenizer, shipped_pair.target.config.vocab_size)


def decode(pair, prompt, grammar, k, sampling=SamplingParams(), max_tokens=MAX_TOKENS):
    tokenizer = pair.tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    params = GenerationParams(max_tokens=max_tokens, num_speculative_tokens=k, sampling=sampling,
                              eos_token_ids=(tokenizer.eos_token_id,), grammar=grammar)  # fmt: skip
    proposer = DraftModelProposer(CachedCausalLM(pair.draft)) if k else None
    out = []
    for step in generate(proposer, TargetVerifier(CachedCausalLM(pair.target)), RejectionSampler(), prompt_ids, params):
        out += step.new_token_ids
    return out, step.finish_reason, step.stats


def json_text(pair, token_ids) -> str:
    return pair.tokenizer.decode([t for t in token_ids if t != pair.tokenizer.eos_token_id])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_speculation_equals_k0_and_hf_generate_with_the_schema(name, shipped_pair, compiler):
    from xgrammar.contrib.hf import LogitsProcessor

    grammar = compiler.compile("json_schema", json.dumps(SCHEMAS[name]))
    tokenizer = shipped_pair.tokenizer
    assert list(compiler.tokenizer_info.stop_token_ids) == [tokenizer.eos_token_id]  # HF's matcher stops as ours
    accepted = 0
    for prompt in PROMPTS:
        plain, reason, _ = decode(shipped_pair, prompt, grammar, 0)
        speculated, reason_k, stats = decode(shipped_pair, prompt, grammar, 3)
        assert speculated == plain and reason_k == reason, (prompt, json_text(shipped_pair, speculated))
        accepted += stats.num_accepted_tokens
        prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
        with torch.inference_mode():
            reference = shipped_pair.target.generate(
                prompt_ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id, logits_processor=[LogitsProcessor(grammar.compiled)])
        assert plain == reference[0, prompt_ids.shape[1]:].tolist()
        if reason == "stop":
            jsonschema.validate(json.loads(json_text(shipped_pair, plain)), SCHEMAS[name])
    assert accepted > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_stop_finish_validates(seed, shipped_pair, compiler):
    sampling = SamplingParams(temperature=1.0, seed=seed)
    stops = 0
    for name, schema in SCHEMAS.items():
        grammar = compiler.compile("json_schema", json.dumps(schema))
        out, reason, _ = decode(shipped_pair, PROMPTS[0], grammar, 3, sampling, max_tokens=64)
        assert reason in ("stop", "length")
        if reason == "stop":
            stops += 1
            assert out[-1] == shipped_pair.tokenizer.eos_token_id
            jsonschema.validate(json.loads(json_text(shipped_pair, out)), schema)
    assert stops >= 3  # the tiny target does finish most of them


def test_json_mode_regex_and_ebnf_outputs_follow_their_guides(shipped_pair, compiler):
    out, reason, _ = decode(shipped_pair, PROMPTS[0], compiler.compile("json", ""), 3)
    if reason == "stop":
        assert isinstance(json.loads(json_text(shipped_pair, out)), dict)
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    out, reason, _ = decode(shipped_pair, PROMPTS[1], compiler.compile("regex", pattern), 3)
    assert reason == "stop" and re.fullmatch(pattern, json_text(shipped_pair, out))
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    out, reason, _ = decode(shipped_pair, PROMPTS[2], compiler.compile("ebnf_grammar", ebnf), 3)
    assert reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]", json_text(shipped_pair, out))


def test_a_grammar_that_cannot_complete_ends_with_length(shipped_pair, compiler):
    grammar = compiler.compile("regex", "a{40}")
    out, reason, _ = decode(shipped_pair, "x", grammar, 3, max_tokens=5)
    assert reason == "length" and len(out) == 5


@pytest.mark.parametrize("guide_type, guide, named", [
    ("json_schema", '{"type": "objec"}', "Unsupported type"),
    ("json_schema", "{not json", "json_schema guide does not compile"),
    ("regex", "[a-", "regex guide does not compile"),
    ("ebnf_grammar", "root ::= missing", "ebnf_grammar guide does not compile"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "tagg"}}', "structural_tag guide does not compile"),
    ("xml", "<a/>", "guide type must be one of json, json_schema, regex, ebnf_grammar, structural_tag"),
])  # fmt: skip
def test_a_bad_guide_is_refused_by_name(guide_type, guide, named, compiler):
    with pytest.raises(GrammarError, match=re.escape(named)):
        compiler.compile(guide_type, guide)
    compiler.compile("regex", "ok")  # and the compiler goes on compiling


def test_min_tokens_with_a_grammar_is_refused(compiler):
    params = GenerationParams(max_tokens=8, min_tokens=2, grammar=compiler.compile("json", ""))
    with pytest.raises(ValueError, match="min_tokens cannot be combined with a grammar"):
        params.validate()


# --- drafts and masks, on a made-up vocabulary -------------------------------------------------------

VOCAB = ["a", "b", "c", "0", "1", "2", "3", "x", "y", "[", "]", ",", "ab", "b0", "z", "<eos>"]
EOS = len(VOCAB) - 1
ID = {t: i for i, t in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def small_compiler():
    info = xgrammar.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    return GrammarCompiler(info, len(VOCAB))


def allowed_ids(row: torch.Tensor) -> set[int]:
    logits = apply_allowed(torch.zeros(1, len(VOCAB)), row[None])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_chain_drafts_are_cut_at_the_first_forbidden_one_and_masks_follow_each_prefix(small_compiler):
    state = GrammarState(small_compiler.compile("regex", "a[b0]+"), (EOS,))
    drafts = [ID["a"], ID["b"], ID["0"], ID["c"], ID["b"]]
    assert state.allowed_drafts(drafts) == [0, 1, 2]
    masks = state.masks(drafts[:3])  # [4, 1]
    assert allowed_ids(masks[0]) == {ID["a"], ID["ab"]}
    assert allowed_ids(masks[1]) == {ID["b"], ID["0"], ID["b0"]}
    assert allowed_ids(masks[3]) == {ID["b"], ID["0"], ID["b0"], EOS}  # EOS only where the grammar may end
    state.accept([ID["a"]])  # masks rolled the matcher back: it still stands after the committed tokens
    assert state.allowed_drafts([ID["a"]]) == [] and state.allowed_drafts([ID["b"], EOS, ID["b"]]) == [0, 1]
    # drafts sampled from q keep their first forbidden one, to be rejected; the row after it is never read
    assert state.allowed_drafts([ID["b"], ID["c"], ID["b"]], keep_first_forbidden=True) == [0, 1]
    assert state.masks([ID["b"], ID["c"]])[2].tolist() == [-1]


def test_tree_nodes_under_a_forbidden_path_are_cut_and_reindexed(small_compiler):
    state = GrammarState(small_compiler.compile("regex", "a[b0]+"), (EOS,))
    tokens = [ID["a"], ID["x"], ID["b"], ID["c"], ID["0"], ID["b"]]
    parents = (ROOT, ROOT, 0, 0, 1, 2)  # x's child 0 lies under a forbidden node
    kept = state.allowed_drafts(tokens, parents)
    assert kept == [0, 2, 5]
    cut = cut_proposal(Proposal(torch.tensor(tokens), parents=parents), kept)
    assert cut.token_ids.tolist() == [ID["a"], ID["b"], ID["b"]] and cut.parents == (ROOT, 0, 1)
    masks = state.masks(cut.token_ids.tolist(), cut.parents)
    assert allowed_ids(masks[2]) == allowed_ids(masks[3]) == {ID["b"], ID["0"], ID["b0"], EOS}
    held = cut_proposal(Proposal(torch.tensor(tokens), parents=parents, probs_held=True), kept)
    assert held.token_ids.tolist() == [ID["a"]]  # a held q is read by a prefix of its drafts


def test_a_sequence_commits_through_its_grammar_and_stops_when_it_terminates(small_compiler):
    grammar = small_compiler.compile("regex", "ab")
    state = SequenceState("s", [1, 2], GenerationParams(max_tokens=8, num_speculative_tokens=2, eos_token_ids=(EOS,),
                                                        grammar=grammar))
    request = state.verify_request(None)
    assert allowed_ids(request.allowed_tokens[0]) == {ID["a"], ID["ab"]}
    from specdec.types import SampleResult

    state.commit(None, SampleResult(torch.tensor([ID["ab"]]), 0))
    proposal = state.constrain(Proposal(torch.tensor([EOS, ID["a"]])))
    assert proposal.token_ids.tolist() == [EOS]
    output = state.commit(proposal, SampleResult(torch.tensor([EOS, ID["a"]]), 1))
    assert output.finished and output.finish_reason == "stop" and state.output_ids == [ID["ab"], EOS]


# --- sampled losslessness ----------------------------------------------------------------------------

PROMPT = [3, 7, 1, 12]
SAMPLING = SamplingParams(temperature=1.0, top_k=3)
NUM_TOKENS = 3
NUM_SAMPLES = 1500
GUIDE = "[ab0-3]{1,3}(x|y)?"  # the mask changes with each prefix, and ends the output early on some paths


def exact_joint(target, grammar) -> dict[tuple[int, ...], float]:
    """P(first NUM_TOKENS outputs, shorter where the grammar ends) under the masked target, by enumeration."""
    joint, done = {(): 1.0}, {}
    for _ in range(NUM_TOKENS):
        extended = {}
        for prefix, mass in joint.items():
            state = GrammarState(grammar, (EOS,))
            state.accept(prefix)
            with torch.inference_mode():
                logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]  # [1, vocab]
            p = process_logits(apply_allowed(logits, state.masks([])), SAMPLING)[0]  # [vocab]
            for token in torch.nonzero(p).flatten().tolist():
                (done if token == EOS else extended)[prefix + (token,)] = mass * float(p[token])
        joint = extended
    return {**joint, **done}


def constrained_pvalue(target, draft, grammar, num_samples: int, under_grammar: bool = True) -> float:
    """The chi-square p-value of speculative constrained samples against the masked target's exact joint;
    ``under_grammar`` False: the draft drafts freely, and its forbidden drafts reach the grammar's cut."""
    expected = exact_joint(target, grammar)
    proposer, verifier = DraftModelProposer(CachedCausalLM(draft)), TargetVerifier(CachedCausalLM(target))
    counts, drafted = Counter(), 0
    for seed in range(num_samples):
        params = GenerationParams(max_tokens=NUM_TOKENS, num_speculative_tokens=3, eos_token_ids=(EOS,),
                                  sampling=SamplingParams(temperature=1.0, top_k=3, seed=seed), grammar=grammar)
        out = []
        for step in generate(proposer, verifier, RejectionSampler(), PROMPT, params, drafts_under_grammar=under_grammar):
            out += step.new_token_ids
            drafted += step.stats.num_draft_tokens if step.stats else 0
        counts[tuple(out)] += 1
    assert set(counts) <= set(expected), set(counts) - set(expected)
    assert drafted > 0
    observed, wanted, small_o, small_e = [], [], 0, 0.0
    for cell in sorted(expected, key=expected.get):  # merge the cells expected under 5 times
        e = expected[cell] * num_samples
        if e < 5:
            small_o, small_e = small_o + counts[cell], small_e + e
        else:
            observed.append(counts[cell])
            wanted.append(e)
    if small_e:
        observed.append(small_o)
        wanted.append(small_e)
    scale = num_samples / sum(wanted)  # the enumerated masses sum to 1 up to float rounding, which chisquare refuses
    return chisquare(observed, [w * scale for w in wanted]).pvalue


@pytest.fixture(scope="module")
def sampled_pair(tiny_llama):
    target = tiny_llama(seed=0, vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():  # q overlaps p but clearly differs from it
        draft.lm_head.weight.add_(0.15 * torch.randn_like(draft.lm_head.weight))
    return target, draft


@pytest.mark.slow
@pytest.mark.parametrize("under_grammar", [True, False], ids=["drafted-under-the-grammar", "drafted-freely"])
def test_sampled_constrained_output_follows_the_masked_target(sampled_pair, small_compiler, under_grammar):
    grammar = small_compiler.compile("regex", GUIDE)
    assert constrained_pvalue(*sampled_pair, grammar, NUM_SAMPLES, under_grammar) > 1e-3


@pytest.mark.slow
def test_withdrawing_a_sampled_forbidden_draft_is_seen_as_lossy(sampled_pair, small_compiler, monkeypatch):
    """The power check: cutting the forbidden draft itself, where q was sampled, draws from p instead of the
    residual, and the same statistic rejects it."""
    allowed_drafts = GrammarState.allowed_drafts
    monkeypatch.setattr(GrammarState, "allowed_drafts", lambda self, d, p=None, keep=False: allowed_drafts(self, d, p))
    assert constrained_pvalue(*sampled_pair, small_compiler.compile("regex", GUIDE), 600, under_grammar=False) < 1e-3
