"""P-EAGLE (``parallel_drafting`` for ``eagle3``): one head pass per step computing what training runs, a cache
of real rows only, losslessness, the checkpoint format and the refusals (tests/eagle3_heads.py builds the heads)."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

from eagle3_heads import DRAFT_VOCAB, PROMPTS, VOCAB, pair, random_peagle
from test_eagle3 import decode_every_prompt_as_hf
from tiny_llama import build_tiny_llama
from specdec.cached_lm import ForwardCall
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer, check_head
from specdec.heads.eagle3 import Eagle3Head
from specdec.heads.cuda_graphs import StaticHeadRunner
from specdec.heads.formats import load_eagle3, save_eagle3
from specdec.heads.peagle import PEagleHead, cod_anchors, group_mask, parallel_train_forward
from specdec.models import CachedCausalLM
from specdec.proposers.eagle3 import Eagle3Proposer
from specdec.proposers.peagle import PEagleProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import process_logits
from specdec.tree import parse_token_tree
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from specdec_triton import speculative_config as sc
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.drafters import build_proposer
from specdec_triton.plumbing import ParameterError, Parameters
from test_sampled_losslessness import NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens

__all__ = ["pair"]  # fixtures

MODELS = Path(__file__).resolve().parents[1] / "models"
TINY_EAGLE3, TINY_PEAGLE = MODELS / "tiny-eagle3", MODELS / "tiny-peagle"
MASK = VOCAB - 1  # any id: a random head was never taught it, which changes nothing the tests check
TRAINER = re.escape("scripts/train_draft_head.py --method eagle3 --parallel-drafting")


@pytest.fixture(scope="module")
def peagle(pair, tmp_path_factory):
    """``pair``'s target and a random two-layer P-EAGLE head for it, in the speculators format."""
    target, target_dir, _ = pair
    head_dir = tmp_path_factory.mktemp("peagle") / "head"
    save_eagle3(random_peagle(target_dir, 5, DRAFT_VOCAB, MASK, num_layers=2), head_dir, verifier=str(target_dir))
    return target, target_dir, head_dir


def features_of(target_dir, tokens: list[int], head) -> torch.Tensor:  # [n - 1, F]
    """The target's hidden states the head reads for ``tokens`` (all but the last, which it has not verified)."""
    lm = FastCausalLM(target_dir, max_num_seqs=1)
    return lm.forward_with_hidden([ForwardCall("f", 0, tokens[:-1], 1)], head.config.aux_layers)[1][0]


def reference_rows(head: PEagleHead, tokens: list[int], features: torch.Tensor, k: int) -> torch.Tensor:
    """[k, vocab]: the rows of drafts 1 .. k on the target's vocabulary, from the training forward over the whole
    sequence with one group of k - 1 masks after its last row."""
    n = len(tokens)
    with torch.no_grad():
        outputs = parallel_train_forward(head, torch.tensor([tokens[1:]]), features[None],
                                         [torch.tensor([n - 2])] * (k - 1))  # fmt: skip
    return head.target_logits(torch.stack([outputs[0][0, n - 2], *(o[0, 0] for o in outputs[1:])]))


def counting_passes(proposer, monkeypatch) -> list[int]:
    """Each head pass the proposer runs, recorded as its tokens per row."""
    passes, forward = [], proposer.head_forward
    monkeypatch.setattr(proposer, "head_forward", lambda ids, *rest: passes.append(ids.shape[1]) or forward(ids, *rest))
    return passes


def test_drafts_are_what_the_training_forward_computes_in_one_pass(peagle, monkeypatch):
    """Greedy drafts are the argmax of each row, sampled ones come with each row's own q; features arriving in
    pieces change nothing, and each propose call is one head pass over the rows the cache lacks and k - 1 masks."""
    _, target_dir, head_dir = peagle
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2, parallel_drafting=True)
    assert isinstance(proposer, PEagleProposer) and proposer.mask_token_id == MASK
    passes = counting_passes(proposer, monkeypatch)
    tokens = PROMPTS[3]
    hidden = features_of(target_dir, tokens, head)
    rows = reference_rows(head, tokens, hidden, 4)
    sampling, split = SamplingParams(temperature=1.0), 9
    proposer.propose([ProposeRequest("s", 0, tokens[: split + 1], 1, sampling, 1, hidden_states=hidden[:split])])
    [sampled] = proposer.propose([ProposeRequest("s", split + 1, tokens[split + 1 :], 4, sampling, 2,
                                                 hidden_states=hidden[split:], hidden_position=split)])  # fmt: skip
    torch.testing.assert_close(sampled.probs, process_logits(rows, sampling), atol=1e-4, rtol=1e-4)
    assert bool((sampled.probs[torch.arange(4), sampled.token_ids] > 0).all())
    assert passes == [split, len(tokens) - 1 - split + 3]  # the rows the cache lacked, then 3 masks
    [greedy] = proposer.propose([ProposeRequest("g", 0, tokens, 4, SamplingParams(), 0, hidden_states=hidden)])
    assert greedy.probs is None and greedy.token_ids.tolist() == rows.argmax(-1).tolist()
    for seq_id in ("s", "g"):
        proposer.release(seq_id)
    assert proposer.num_active_sequences == 0


def test_the_cache_keeps_real_rows_only(peagle, monkeypatch):
    """Steps that accept some drafts, none, all, and one cut back: every step's drafts are those of a fresh forward
    over the whole sequence (a mask's keys left where the next call reads them would change them)."""
    _, target_dir, head_dir = peagle
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=1, parallel_drafting=True)
    passes = counting_passes(proposer, monkeypatch)
    full = [1 + (7 * i + i * i) % (VOCAB - 2) for i in range(48)]  # never the mask token
    hidden = features_of(target_dir, full, head)  # [47, F]
    k, n, greedy = 4, 10, SamplingParams()
    proposer.propose([ProposeRequest("s", 0, full[:n], k, greedy, 0, hidden_states=hidden[: n - 1])])
    for accepted, back in ((2, 0), (0, 0), (4, 0), (1, 2), (3, 0)):  # back: tokens resent from further back
        position, n = n - back, n + accepted + 1
        [proposal] = proposer.propose([ProposeRequest("s", position, full[position:n], k, greedy, 0,
                                                      hidden_position=position - 1,
                                                      hidden_states=hidden[position - 1 : n - 1])])  # fmt: skip
        assert proposal.token_ids.tolist() == reference_rows(head, full[:n], hidden[: n - 1], k).argmax(-1).tolist()
    assert len(passes) == 6  # one head pass a step, whatever k is


def test_a_batch_drafts_each_sequence_its_own_k_as_alone(peagle):
    _, target_dir, head_dir = peagle
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    prompts = {"a": PROMPTS[3], "b": PROMPTS[2], "c": PROMPTS[0], "d": PROMPTS[3][:12]}
    hidden = {s: features_of(target_dir, t, head) for s, t in prompts.items()}
    ks = {"a": 3, "b": 1, "c": 0, "d": 5}

    def propose(seq_ids):
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, parallel_drafting=True)
        requests = [ProposeRequest(s, 0, prompts[s], ks[s], SamplingParams(), 0, hidden_states=hidden[s])
                    for s in seq_ids]  # fmt: skip
        return {s: p.token_ids.tolist() for s, p in zip(seq_ids, proposer.propose(requests))}

    together = propose(list(prompts))
    assert together["c"] == [] and [len(together[s]) for s in "abd"] == [3, 1, 5]
    for seq_id in prompts:
        assert together[seq_id] == propose([seq_id])[seq_id], seq_id


def test_min_tokens_bans_only_the_drafts_it_binds(peagle):
    _, target_dir, head_dir = peagle
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    tokens = PROMPTS[3]
    hidden = features_of(target_dir, tokens, head)
    rows = reference_rows(head, tokens, hidden, 3)
    banned = int(rows[0].argmax())  # the first draft's own choice: banning it must move that draft alone
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=1, parallel_drafting=True)
        [proposal] = proposer.propose([ProposeRequest("s", 0, tokens, 3, sampling, 0, hidden_states=hidden,
                                                      num_banned_tokens=1, banned_token_ids=(banned,))])  # fmt: skip
        assert int(proposal.token_ids[0]) != banned
        if sampling.greedy:
            assert proposal.token_ids[1:].tolist() == rows[1:].argmax(-1).tolist()
        else:
            assert proposal.probs[0, banned] == 0 and proposal.probs[1:, banned].sum() > 0


def test_compiled_for_cpu_it_drafts_what_it_drafts_eagerly_and_compiles_nothing_for_a_request(peagle):
    """With ``cpu_compile`` (the served default on CPU) the head's passes compile at load, through the warm-up's
    own propose calls: the drafts are the eager ones for any k and batch, sampled too, and no request compiles."""
    _, target_dir, head_dir = peagle
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    prompts = {"a": PROMPTS[3], "b": PROMPTS[2], "c": PROMPTS[0]}
    hidden = {s: features_of(target_dir, t, head) for s, t in prompts.items()}
    compiled = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, cpu_compile=True,
                                   parallel_drafting=True)  # fmt: skip
    eager = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, parallel_drafting=True)
    compiles = counters["aot_autograd"]["total"]
    for seq_ids in (("b",), ("a", "b"), ("a", "b", "c")):
        for k, sampling in ((1, SamplingParams()), (3, SamplingParams()), (6, SamplingParams(temperature=1.0))):
            requests = [ProposeRequest(s, 0, prompts[s], k, sampling, 1, hidden_states=hidden[s]) for s in seq_ids]
            for proposer in (compiled, eager):
                proposals = proposer.propose(requests)
                for seq_id in seq_ids:
                    proposer.release(seq_id)
                if proposer is compiled:
                    drafts = [p.token_ids.tolist() for p in proposals]
            assert drafts == [p.token_ids.tolist() for p in proposals], (seq_ids, k)
    assert counters["aot_autograd"]["total"] == compiles, "every graph is compiled at load, none by a request"


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_output_equals_hf_generate_for_every_k(peagle, engine):
    target, target_dir, head_dir = peagle
    lm = FastCausalLM(target_dir, max_num_seqs=4) if engine == "fast" else CachedCausalLM(target)
    verifier = TargetVerifier(lm)
    proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, parallel_drafting=True)
    assert decode_every_prompt_as_hf(target, proposer, verifier, range(1, 6)) > 0, "the accepted path must run"
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs CUDA")]),
])  # fmt: skip
def test_fixed_shape_passes_are_lossless(peagle, device):
    """A step's pass (the rows the cache lacks and the masks) padded to a captured bucket: replayed as a CUDA graph,
    or, on CPU, the same fixed-shape pass uncaptured (``StaticHeadRunner``); output stays HF's."""
    target, target_dir, head_dir = peagle
    lm = FastCausalLM(target_dir, dtype="float32", device=device, max_num_seqs=4)
    proposer = build_head_proposer("eagle3", head_dir, target_dir, "float32", device, max_num_seqs=4,
                                   parallel_drafting=True)  # fmt: skip
    if device == "cpu":
        proposer.graphs = StaticHeadRunner(proposer.head, proposer.cache)
    buckets = []
    bucket = proposer.graphs.bucket
    proposer.graphs.bucket = lambda b, s: buckets.append(bucket(b, s)) or buckets[-1]
    assert decode_every_prompt_as_hf(target, proposer, TargetVerifier(lm), (1, 3, 5)) > 0
    assert any(b is not None for b in buckets), "a step's pass must fit a bucket"


@pytest.mark.slow
def test_speculative_sampling_with_parallel_drafts_matches_the_target_distribution(tmp_path):
    """The chi-square test of ``test_sampled_losslessness`` with a P-EAGLE head's q: draft j drawn from its own
    row's q_j, which does not see drafts 1 .. j - 1."""
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    head = random_peagle(tmp_path / "target", 3, 12, 15, aux_layers=(0, 1, 1), scale=0.5, num_layers=2)
    save_eagle3(head, tmp_path / "head", verifier="target")
    proposer = build_head_proposer("eagle3", tmp_path / "head", tmp_path / "target", max_num_seqs=2,
                                   parallel_drafting=True)  # fmt: skip
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_the_format_round_trips_and_the_head_loads_as_either_drafter(peagle, tmp_path):
    """``mask_hidden`` [1, 1, 3 * target_hidden] among the weights, ``parallel_drafting`` and ``mask_token_id`` in
    config.json; read back the same, or, without parallel_drafting, the EAGLE-3 head it also is."""
    _, target_dir, head_dir = peagle
    raw = json.loads((head_dir / "config.json").read_text())
    assert (raw["speculators_model_type"], raw["parallel_drafting"], raw["mask_token_id"]) == ("eagle3", True, MASK)
    assert load_file(head_dir / "model.safetensors")["mask_hidden"].shape == (1, 1, 3 * 32)
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu", parallel_drafting=True)
    save_eagle3(head, tmp_path / "again", verifier=str(target_dir))
    again = load_eagle3(tmp_path / "again", target_dir, torch.float32, "cpu", parallel_drafting=True)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == raw
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in head.state_dict().items())
    chain = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    assert type(chain) is Eagle3Head and chain.state_dict().keys() == head.state_dict().keys() - {"mask_hidden"}
    assert type(build_head_proposer("eagle3", head_dir, target_dir)) is Eagle3Proposer
    check_head("eagle3", head_dir, target_dir, parallel_drafting=True)
    for keys, expected in (({"ptd_token_id": 5}, 5), ({"mask_token_id": 7, "ptd_token_id": 5}, 7)):  # vLLM's order
        shutil.copytree(head_dir, tmp_path / "ptd", dirs_exist_ok=True)
        other = {k: v for k, v in raw.items() if k != "mask_token_id"} | keys
        (tmp_path / "ptd" / "config.json").write_text(json.dumps(other))
        assert load_eagle3(tmp_path / "ptd", target_dir, torch.float32, "cpu", True).mask_token_id == expected


def test_an_eagle3_head_without_a_mask_token_or_mask_hidden_is_refused_naming_both(pair, peagle, tmp_path):
    _, target_dir, eagle3_dir = pair
    with pytest.raises(ValueError, match=rf"draft head '{re.escape(str(eagle3_dir))}' names no mask token "
                                         rf"\('mask_token_id' or 'ptd_token_id' in its config.json\); serve one "
                                         rf"trained to draft in parallel \(models/tiny-peagle, {TRAINER}\)"):  # fmt: skip
        build_head_proposer("eagle3", eagle3_dir, target_dir, parallel_drafting=True)
    shutil.copytree(peagle[2], tmp_path / "head")
    weights = load_file(tmp_path / "head" / "model.safetensors")
    del weights["mask_hidden"]
    save_file(weights, tmp_path / "head" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"has no 'mask_hidden' among its weights; .*{TRAINER}"):
        check_head("eagle3", tmp_path / "head", target_dir, parallel_drafting=True)
    with pytest.raises(ValueError, match="has no 'mask_hidden' among its weights"):
        load_eagle3(tmp_path / "head", target_dir, torch.float32, "cpu", parallel_drafting=True)
    with pytest.raises(ValueError, match=r"parallel_drafting drafts a chain in one forward"):
        build_head_proposer("eagle3", peagle[2], target_dir, tree=parse_token_tree("[(0,), (1,)]"),
                            parallel_drafting=True)  # fmt: skip


@pytest.mark.skipif(not TINY_EAGLE3.is_dir(), reason="models/tiny-eagle3 not trained")
def test_the_shipped_eagle3_head_is_refused_for_parallel_drafting_where_it_loads():
    config = head_config(TINY_EAGLE3)
    assert config.parallel_drafting
    with pytest.raises(ValueError, match=rf"'{re.escape(str(TINY_EAGLE3))}' names no mask token"):
        build_proposer(config, "cpu")


def head_config(head_dir, parallel: str = "true", **more) -> DraftProposerConfig:
    params = {"method": "eagle3", "draft_model": str(head_dir), "parallel_drafting": parallel,
              "target_model": str(MODELS / "tiny-target"), **more}  # fmt: skip
    return DraftProposerConfig.from_parameters(Parameters(params, component="draft_proposer"))


@pytest.mark.parametrize("beside", [False, True])
def test_config_pbtxt_serves_it_in_either_placement_and_says_so(peagle, beside):
    _, target_dir, head_dir = peagle
    config = replace(head_config(head_dir, run_with_target=str(beside).lower()), target_model=str(target_dir))
    assert config.parallel_drafting and config.beside_target == beside
    lines = []
    loaded = build_proposer(config, "cpu", log=lines.append)
    assert type(loaded.proposer) is PEagleProposer and loaded.description.method == "eagle3"
    assert any("drafts a step's tokens in one forward (P-EAGLE), mask token 31" in line for line in lines), lines
    assert type(build_proposer(replace(config, parallel_drafting=False), "cpu").proposer) is Eagle3Proposer
    with pytest.raises(ParameterError, match=r"'speculative_token_tree' .* with method 'eagle3' needs "
                                             r"parallel_drafting false .*; got parallel_drafting true"):  # fmt: skip
        head_config(head_dir, speculative_token_tree="[(0,), (1,)]")


def test_vllms_key_sets_it_and_other_methods_are_refused_by_name():
    settings = sc.parse('{"method": "eagle3", "model": "/ckpt/peagle", "num_speculative_tokens": 4, '
                        '"parallel_drafting": true}')  # fmt: skip
    assert settings["draft_proposer"] == {"method": "eagle3", "draft_model": "/ckpt/peagle",
                                          "parallel_drafting": "true"}  # fmt: skip
    for method in ("mlp_speculator", "medusa", "dflash", "suffix"):
        with pytest.raises(sc.SpeculativeConfigError, match=rf"key 'parallel_drafting' true is for methods "
                                                             rf"\['draft_model', 'eagle3'\], not '{method}'"):  # fmt: skip
            sc.parse(json.dumps({"method": method, "parallel_drafting": True}))
    with pytest.raises(ValueError, match=r"parallel_drafting is for methods \['draft_model', 'eagle3'\], not 'dflash'"):
        build_head_proposer("dflash", "/no/such/head", MODELS / "tiny-target", parallel_drafting=True)


def test_cod_anchors_nest_and_the_group_mask_is_what_a_step_attends():
    groups = cod_anchors(20, 5, 0.5, torch.Generator().manual_seed(0))
    assert [len(g) for g in groups] == [10, 5, 2, 1]
    for d, (shallow, deep) in enumerate(zip(groups, groups[1:]), 2):
        assert set(deep.tolist()) <= set(shallow.tolist()) and int(deep.max()) <= 19 - d
    assert [len(g) for g in cod_anchors(6, 3, 1.0, torch.Generator())] == [5, 4]  # every anchor with a label
    anchors, depths = torch.tensor([0, 1, 2, 1, 1, 2]), torch.tensor([0, 0, 0, 1, 2, 1])  # real 0..2, group 1, 2's d1
    assert group_mask(anchors, depths).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # anchor 1's depth 1: the real rows up to 1, itself
        [1, 1, 0, 1, 1, 0],  # anchor 1's depth 2: and its group's depth 1
        [1, 1, 1, 0, 0, 1],
    ]


@pytest.mark.skipif(not TINY_PEAGLE.is_dir(), reason="models/tiny-peagle not trained")
@pytest.mark.parametrize("parallel", [True, False])
def test_the_shipped_peagle_head_loads_as_either_drafter(parallel):
    loaded = build_proposer(head_config(TINY_PEAGLE, str(parallel).lower()), "cpu")
    assert type(loaded.proposer) is (PEagleProposer if parallel else Eagle3Proposer)
    assert loaded.description.method == "eagle3" and loaded.description.hidden_state_layers == (1, 3, 5)
