"""bench/engine.py: the step scheduler over in-process stages decodes as the target alone does."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.engine import LocalStages, run_phase
from specdec.engine import GenerationParams
from specdec.fast import FastCausalLM
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.verifier import TargetVerifier
from tiny_llama import hf_generate_greedy

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TARGET, SHIPPED_DRAFT = REPO_ROOT / "models" / "tiny-target", REPO_ROOT / "models" / "tiny-draft"
PROMPTS = [[5, 17, 99, 3, 250, 8], [42, 42, 42, 7], list(range(300, 330))]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def stages(shipped_pair):
    target = FastCausalLM(SHIPPED_TARGET, "float32", max_num_seqs=4, max_model_len=128)
    draft = FastCausalLM(SHIPPED_DRAFT, "float32", max_num_seqs=4, max_model_len=128)
    return LocalStages(TargetVerifier(target), RejectionSampler("strict"), DraftModelProposer(draft))


@pytest.mark.parametrize("k, concurrency", [(0, 1), (3, 1), (3, 2), (4, 3)])
def test_a_phase_equals_hf_generate_and_counts_what_it_did(shipped_pair, stages, k, concurrency):
    params = GenerationParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, num_speculative_tokens=k)
    phase = run_phase(stages, PROMPTS, params, concurrency)
    assert phase.outputs == [hf_generate_greedy(shipped_pair.target, p, MAX_TOKENS) for p in PROMPTS]
    summary = phase.summary()
    assert summary["requests"] == len(PROMPTS) and summary["output_tokens"] == len(PROMPTS) * MAX_TOKENS
    assert max(len(s.sequences) for s in phase.steps) == min(concurrency, len(PROMPTS))  # the slots it was given
    if k:
        acceptance = phase.acceptance
        assert acceptance.num_accepted_tokens > 0  # the accepted path ran
        assert sum(acceptance.accepted_per_position) == acceptance.num_accepted_tokens
        assert 1.0 < summary["mean_accepted_length"] <= k + 1
    assert stages.verifier.num_active_sequences == 0 and stages.proposer.num_active_sequences == 0


def test_a_phase_whose_k_follows_acceptance_equals_hf_generate(shipped_pair, stages):
    params = GenerationParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, num_speculative_tokens=4)
    phase = run_phase(stages, PROMPTS, params, 2, follows_acceptance=True)
    assert phase.outputs == [hf_generate_greedy(shipped_pair.target, p, MAX_TOKENS) for p in PROMPTS]
    assert all(s.num_draft_tokens <= 4 for step in phase.steps for s in step.sequences)


def test_a_step_that_asks_for_drafts_without_a_proposer_fails_the_phase(stages):
    no_proposer = LocalStages(stages.verifier, stages.sampler)
    with pytest.raises(ValueError, match="no proposer"):
        run_phase(no_proposer, PROMPTS[:1], GenerationParams(max_tokens=4, num_speculative_tokens=2), 1)
    assert stages.verifier.num_active_sequences == 0


def _benchmark_engine():
    spec = importlib.util.spec_from_file_location("benchmark_engine", REPO_ROOT / "scripts" / "benchmark_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("benchmark_engine", module)
    spec.loader.exec_module(module)
    return module


def test_the_lossless_check_names_a_configuration_that_differs():
    check = _benchmark_engine().lossless_failures
    same = {("k0", 0, 1): [[1, 2], [3]], ("eagle3", 4, 1): [[1, 2], [3]]}
    assert check(same) == []
    differs = {("k0", 0, 1): [[1, 2], [3]], ("eagle3", 4, 1): [[1, 2], [4]]}
    assert check(differs) == ["eagle3 k=4 at concurrency 1: output differs from k0's on prompts [1]"]


def test_configs_parse_and_always_include_k0():
    parse = _benchmark_engine().parse_configs
    assert parse("draft_model:4,eagle3:2") == [("k0", 0), ("draft_model", 4), ("eagle3", 2)]
    assert parse("eagle3+suffix:8") == [("k0", 0), ("eagle3+suffix", 8)]
    assert parse("draft_model+follow:8") == [("k0", 0), ("draft_model+follow", 8)]  # k up to 8, as acceptance says
    assert parse("medusa:4,medusa+tree:8") == [("k0", 0), ("medusa", 4), ("medusa+tree", 8)]
    assert parse("mtp:2") == [("k0", 0), ("mtp", 2)]  # the target's own MTP layer
    assert parse("draft_model+pard:6") == [("k0", 0), ("draft_model+pard", 6)]  # parallel_drafting
    assert parse("eagle3+pard:4") == [("k0", 0), ("eagle3+pard", 4)]  # P-EAGLE
    with pytest.raises(Exception, match=r"\+pard \(parallel_drafting\) is for draft_model and eagle3"):
        parse("medusa+pard:4")
    with pytest.raises(Exception, match="METHOD:K"):
        parse("eagle:3")
    with pytest.raises(Exception, match="METHOD:K"):
        parse("suffix+suffix:3")


def test_the_engine_benchmark_bans_eos_until_max_tokens_as_the_served_requests_do(monkeypatch, shipped_pair):
    """min_tokens = max_tokens means nothing without the EOS ids: the target could end its text and run on
    past it, a workload the served benchmark (whose requests ban EOS) never sees."""
    from bench.hf import generation_config
    from specdec_triton.text import TextCodec  # the served tokenizer's rule

    module = _benchmark_engine()
    monkeypatch.setattr(sys, "argv", ["benchmark_engine.py", "--configs", "draft_model:2", "--num-prompts", "2",
                                      "--max-tokens", "8", "--no-hf"])  # fmt: skip
    run = module.Run(module.parse_args())
    eos = tuple(TextCodec(str(SHIPPED_TARGET)).eos_token_ids)
    assert eos and {params.eos_token_ids for params in run.params_for.values()} == {eos}
    assert all(params.min_tokens == params.max_tokens == 8 for params in run.params_for.values())
    config = generation_config(8, list(eos), ignore_eos=True)  # the HF row bans the same ids
    assert (config.eos_token_id, config.min_new_tokens, config.pad_token_id) == (list(eos), 8, eos[0])


def test_a_suffix_first_configuration_runs_through_the_engine_benchmark_exactly(monkeypatch, shipped_pair):
    module = _benchmark_engine()
    monkeypatch.setattr(sys, "argv", ["benchmark_engine.py", "--configs", "draft_model+suffix:4", "--num-prompts", "2",
                                      "--max-tokens", "16", "--concurrency", "1", "--rounds", "1", "--no-hf",
                                      "--timing-repeats", "1", "--model-k", "2"])  # fmt: skip
    run = module.Run(module.parse_args())
    run.measure(False, lambda: None)
    assert run.failures == []  # every output equal to k0's
    [summary] = run.results[("cpu", "draft_model+suffix", 4, 1)]
    assert summary["tokens_per_s_aggregate"] > 0
    drafted = summary["proposals_from_suffix"] + summary["proposals_from_model"]  # a sequence's step each
    assert drafted > 0 and summary["suffix_share"] == summary["proposals_from_suffix"] / drafted
    accepted = sum(summary[f"proposals_from_{s}"] * summary[f"accepted_per_step_{s}"]
                   for s in ("suffix", "model") if summary[f"proposals_from_{s}"])  # fmt: skip
    assert accepted == pytest.approx(summary["num_accepted_tokens"])
    [k0] = run.results[("cpu", "k0", 0, 1)]
    assert "suffix_share" not in k0


def test_a_guided_configuration_parses_with_its_constrained_k0_and_is_checked_against_it():
    module = _benchmark_engine()
    assert module.parse_configs("eagle3:3,eagle3+json:3") == [("k0", 0), ("eagle3", 3), ("k0+json", 0),
                                                              ("eagle3+json", 3)]  # fmt: skip
    assert module.parse_configs("k0+json,medusa+tree+json:4") == [("k0", 0), ("k0+json", 0), ("medusa+tree+json", 4)]
    with pytest.raises(Exception, match="optionally followed by"):
        module.parse_configs("eagle3+json+tree:3")  # the guide comes last
    outputs = {("k0", 0, 1): [[1, 2]], ("k0+json", 0, 1): [[7, 8]], ("eagle3", 3, 1): [[1, 2]],
               ("eagle3+json", 3, 1): [[7, 8]]}  # fmt: skip
    assert module.lossless_failures(outputs) == []  # each against k0 under the same guide
    outputs[("eagle3+json", 3, 1)] = [[1, 2]]
    assert module.lossless_failures(outputs) == ["eagle3+json k=3 at concurrency 1: output differs from k0+json's "
                                                 "on prompts [0]"]  # fmt: skip


def test_guided_requests_follow_the_guide_and_equal_constrained_k0(monkeypatch, tmp_path, shipped_pair):
    """The guide reaches every request of a ``+json`` configuration, and only theirs; ratios pair by round."""
    module = _benchmark_engine()
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}')
    monkeypatch.setattr(sys, "argv", ["benchmark_engine.py", "--configs", "draft_model:2,draft_model+json:2",
                                      "--num-prompts", "2", "--max-tokens", "12", "--concurrency", "1", "--rounds", "1",
                                      "--no-hf", "--timing-repeats", "1", "--guide", str(schema)])  # fmt: skip
    run = module.Run(module.parse_args())
    run.measure(False, lambda: None)
    assert run.failures == []  # draft_model+json's outputs equal k0+json's, draft_model's equal k0's
    verifier = TargetVerifier(FastCausalLM(SHIPPED_TARGET, "float32", max_num_seqs=1, max_model_len=run.max_model_len))
    for method, head in (("k0+json", '{"note": "'), ("k0", None)):
        texts = [shipped_pair.tokenizer.decode(ids) for ids in
                 run._phase(method, verifier, None, run.prompts, 0, 1, "check").outputs]  # fmt: skip
        assert all(text.startswith(head) for text in texts) if head else not any(t.startswith('{"note') for t in texts)
    rows = {row["config"]: row for row in run.sections()["rows"]}
    guided = rows["draft_model+json k=2"]
    assert guided["x_unguided"] == guided["tokens_per_s_aggregate"] / rows["draft_model k=2"]["tokens_per_s_aggregate"]
    assert guided["x_k0"] == guided["tokens_per_s_aggregate"] / rows["k0+json"]["tokens_per_s_aggregate"]
    assert run.sections()["guide"]["required"] == ["note"]
