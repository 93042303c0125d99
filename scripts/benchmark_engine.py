#!/usr/bin/env python3
"""Benchmark the engine in this process: the step scheduler over the fast engine, no server.

What a served step costs on top of its forward is measured by ``scripts/benchmark.py``;
this script measures the engine underneath, on any device and without ``tritonserver``
(a lent GPU has none). One run compares, on the same target and prompts, closed loop at
each concurrency, with the configurations interleaved round by round:

* ``k0`` -- plain decoding through the same scheduler (one target pass per token);
* ``METHOD:K`` -- ``draft_model``, ``eagle3``, ``mlp_speculator``, ``medusa``, ``dflash``, ``mtp`` (the target's own
  MTP layer, read from ``--target``), ``ngram`` or ``suffix`` drafting K tokens every step; ``METHOD+tree:K`` (``eagle3``, ``medusa``) drafting
  the static tree ``--token-tree`` cut to K nodes (``DraftTree.first``); ``METHOD+suffix:K`` (a model method)
  with suffix decoding in front of it (``specdec.suffix_first``, ``--suffix-min-score``, ``--model-k``);
  ``METHOD+follow:K`` drafting at most K, each sequence as its acceptance and the measured
  step costs say (``specdec.follow_acceptance``), what it learned carried from phase to phase
  (the warm-up's included) as a server's scheduler carries it from request to request; ``draft_model+pard:K``
  the draft model ``--pard-draft`` drafting K tokens in one forward (PARD, ``parallel_drafting``), ``eagle3+pard:K``
  the P-EAGLE head ``--peagle`` doing so (``specdec.proposers.peagle``);
* ``+json`` after any of them (``k0+json``, ``eagle3+json:3``, ``eagle3+tree+json:4``) -- every request
  constrained by the JSON schema ``--guide`` (default: ``bench.engine_configs.DEFAULT_GUIDE``), applied
  in the verifier as a served ``guided_decoding_guide`` is (``specdec.grammar``); ``k0+json`` is added
  as its reference. A guide decides where an output ends, so its requests may end before
  ``--max-tokens`` (EOS is allowed where the grammar is complete) where the others ban EOS;
* each of them with CUDA graphs captured and without (``--cuda-graphs on,off``, CUDA only);
* ``hf plain`` -- Hugging Face ``generate`` on the same target, one request at a time.

Figures: tokens/s, ITL p50/p99, tokens per verify step, acceptance per position, each
configuration against its own k0 (same graphs setting and guide), a ``+json`` one against itself
unconstrained (``x_unguided``, when both ran), and against HF plain, and at one
stream the analytic bound (``bench.bound``) from the target's forward times measured here
and the proposer's measured cost per step, with the efficiency against it. With
``--synthetic-acceptance-rate R`` (random-weight checkpoints, whose drafts the target
never accepts) each draft position is accepted with probability R whatever the tokens
are; otherwise decoding is greedy and every configuration's output must equal k0's token
for token (``k0+json``'s under the guide), or the run fails. On a CPU the forwards run
uncompiled (the served models' ``cpu_compile`` is not applied here): its CPU steps are slower
than the served models'. Writes ``benchmarks/results/engine-<UTC date-time>-<commit>.json``.

    python scripts/benchmark_engine.py --target models/tiny-target --draft models/tiny-draft \\
        --configs k0,draft_model:4,eagle3:4 --eagle3 models/tiny-eagle3 --concurrency 1,4
    python scripts/benchmark_engine.py --configs k0,eagle3:3,eagle3+json:3 --concurrency 1 --no-hf  # JSON or not
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench import report  # noqa: E402
from bench.bound import forward_ms  # noqa: E402
from bench.engine import LocalStages, build_proposer, run_phase  # noqa: E402
from bench.engine_configs import (  # noqa: E402
    FOLLOW, K0, PARALLEL, TREE, base, guided, parse_configs, read_guide, unguided,
)  # fmt: skip
from bench.engine_rows import HF_PLAIN, add_ratios, lossless_failures, summarize, table  # noqa: E402
from bench.repository import method_of, suffix_first  # noqa: E402
from bench.roofline import floor_ms, memory_bandwidth_gbps  # noqa: E402
from specdec.engine import GenerationParams  # noqa: E402
from specdec.fast import FastCausalLM  # noqa: E402
from specdec.fast.checkpoint import read_config  # noqa: E402
from specdec.follow_acceptance import DraftLengths  # noqa: E402
from specdec.grammar import GrammarCompiler  # noqa: E402
from specdec.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402
from specdec.proposers.model_free import MODEL_FREE_METHODS  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402
from specdec.speculation_length import SpeculationLength  # noqa: E402
from specdec.suffix_first import DEFAULT_MIN_SCORE, SuffixFirst, SuffixFirstConfig, SuffixFirstStages  # noqa: E402
from specdec.tree import DynamicTree, parse_token_tree  # noqa: E402
from specdec.verifier import TargetVerifier  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--pard-draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft-pard",
                   help="draft_model+pard:K's draft: a PARD checkpoint naming its mask token (pard_token)")
    p.add_argument("--eagle3", type=Path, default=REPO_ROOT / "models" / "tiny-eagle3", help="EAGLE-3 head directory")
    p.add_argument("--peagle", type=Path, default=REPO_ROOT / "models" / "tiny-peagle",
                   help="eagle3+pard:K's head: a P-EAGLE head (mask_hidden, mask_token_id)")
    p.add_argument("--mlp-speculator", type=Path, default=REPO_ROOT / "models" / "tiny-mlp-speculator")
    p.add_argument("--medusa", type=Path, default=REPO_ROOT / "models" / "tiny-medusa", help="Medusa heads directory")
    p.add_argument("--dflash", type=Path, default=REPO_ROOT / "models" / "tiny-dflash", help="DFlash drafter directory")
    p.add_argument("--configs", type=parse_configs, default=parse_configs("k0,draft_model:4"))
    p.add_argument("--guide", type=Path, default=None,
                   help="METHOD+json:K: a JSON schema file every request follows (default: a built-in record)")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--cuda-graphs", default="on", help="on, off or on,off (CUDA only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="configurations interleaved, medians over rounds")
    p.add_argument("--prompts", choices=("held-out", "random"), default="held-out",
                   help="held-out text (the target's tokenizer) or random token ids")  # fmt: skip
    p.add_argument("--synthetic-acceptance-rate", type=float, default=None)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF generate baseline")
    p.add_argument("--timing-repeats", type=int, default=20)
    p.add_argument("--suffix-min-score", type=float, default=DEFAULT_MIN_SCORE,
                   help="METHOD+suffix: the score at which suffix decoding's draft is taken")
    p.add_argument("--model-k", type=int, default=0, help="METHOD+suffix: the model's drafts per step (0: K)")
    p.add_argument("--token-tree", default="[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]",
                   help="METHOD+tree:K: the static tree (vLLM's speculative_token_tree) cut to K nodes, rank-0 paths first")
    p.add_argument("--dynamic-tree", default=None, metavar="TOPK,DEPTH",
                   help="METHOD+tree:K: EAGLE-2's dynamic tree of K nodes instead of --token-tree (specdec.tree.DynamicTree)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--commit", default=None, help="the checkout's commit, recorded as given (default: git's; a copy without .git says unknown)")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.graphs = [{"on": True, "off": False}[g.strip()] for g in args.cuda_graphs.split(",")]
    if args.device == "cpu":
        args.graphs = [False]
    return args


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    if args.prompts == "random":
        gen = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                for _ in range(args.num_prompts)]  # fmt: skip
    from transformers import AutoTokenizer

    from bench.workload import held_out_texts, select_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    chosen = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.num_prompts,
                            args.prompt_tokens, args.seed)  # fmt: skip
    return [p.token_ids for p in chosen]


def step_times(lm: FastCausalLM, ks: list[int], context: int, repeats: int) -> dict[str, float]:
    shapes = {f"target_{n}": (lm, n) for n in sorted({1, *(k + 1 for k in ks)})}
    return forward_ms(shapes, context, repeats=repeats)


class Run:
    """One run's measurements as they accumulate; ``sections()`` at any point is what was measured so far."""

    def __init__(self, args):
        self.args = args
        self.ks = sorted({k for _, k in args.configs if k})
        self.prompts = make_prompts(args, read_config(args.target).vocab_size)
        # held-out prompts end on a line, so some are longer than --prompt-tokens
        self.max_model_len = max(map(len, self.prompts)) + args.max_tokens + max(self.ks, default=0) + 8
        self.max_num_seqs = max(*args.concurrency, len(self.ks) + 1)  # the step timings hold one sequence per shape
        rule = ("synthetic", args.synthetic_acceptance_rate) if args.synthetic_acceptance_rate is not None else ("strict", 0.0)
        self.sampler = RejectionSampler(*rule)
        # EOS is banned until max_tokens, as the served benchmark's requests (min_tokens = max_tokens) ban it
        tokenizer = load_tokenizer(args.target)
        self.eos_token_ids = tuple(eos_token_ids(tokenizer, args.target))
        self.params_for = {k: GenerationParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                                               eos_token_ids=self.eos_token_ids, num_speculative_tokens=k)
                           for k in {k for m, k in args.configs if not guided(m)}}  # fmt: skip
        # under the guide the grammar decides the end (no min_tokens): EOS only where the schema is complete
        self.guide = read_guide(args.guide) if any(guided(m) for m, _ in args.configs) else None
        grammar = None if self.guide is None else GrammarCompiler(tokenizer, read_config(args.target).vocab_size).compile(
            "json_schema", self.guide)  # fmt: skip
        self.guided_params_for = {k: GenerationParams(max_tokens=args.max_tokens, eos_token_ids=self.eos_token_ids,
                                                      num_speculative_tokens=k, grammar=grammar)
                                  for k in {k for m, k in args.configs if guided(m)}}  # fmt: skip
        self.results: dict[tuple[str, str, int, int], list[dict]] = {}  # (graphs, method, k, c) -> rounds
        self.times: dict[str, dict[str, float]] = {}
        self.floor: dict | None = None
        self.failures: list[str] = []
        self.k0_outputs: list[list[int]] | None = None
        self.hf: dict | None = None
        self.lengths: dict[tuple[str, int], DraftLengths] = {}  # a +follow configuration's, kept across its phases

    @property
    def greedy(self) -> bool:
        return self.args.synthetic_acceptance_rate is None

    def measure(self, graphs: bool, save) -> None:
        """Every configuration at every concurrency, rounds interleaved, on one engine setting; ``save()`` after each round."""
        args = self.args
        tag = "graphs" if graphs else ("eager" if args.device != "cpu" else "cpu")
        print(f"[engine] loading {args.target} ({tag}) on {args.device}", flush=True)
        lm = FastCausalLM(args.target, args.dtype, args.device, self.max_num_seqs, self.max_model_len, cuda_graphs=graphs)
        verifier = TargetVerifier(lm)
        proposers = {m: self._proposer(m, graphs) for m, k in args.configs if k}  # a +tree one is cut to each k
        self.times[tag] = step_times(lm, self.ks, args.prompt_tokens + args.max_tokens // 2, args.timing_repeats)
        self.floor = self.floor or roofline(lm, args.device)
        print(f"[engine] {tag} target step ms: " + ", ".join(f"{n} {ms:.2f}" for n, ms in self.times[tag].items()))
        for method, k in args.configs:  # one unmeasured request each: lazy allocations, kernel choice, graph capture
            self._phase(method, verifier, proposers.get(method), self.prompts[:1], k, 1, "warm")
        outputs: dict[tuple[str, int, int], list[list[int]]] = {}
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else list(reversed(args.configs))  # no configuration always first
            for c in args.concurrency:
                for method, k in order:
                    if base(method) in MODEL_FREE_METHODS:  # a fresh suffix tree: phases repeat prompts
                        proposers[method] = self._proposer(method, graphs)
                    phase = self._phase(method, verifier, proposers.get(method), self.prompts, k, c, f"r{r}")
                    summary = phase.summary()
                    self.results.setdefault((tag, method, k, c), []).append(summary)
                    outputs[(method, k, c)] = phase.outputs
                    print(f"[engine] round {r + 1}/{args.rounds} {tag} c={c} {method} k={k}: "
                          f"{summary['tokens_per_s_aggregate']:.1f} tok/s, ITL p50 {summary['itl_ms_p50']:.2f} ms, "
                          f"L {summary['mean_accepted_length']:.2f}", flush=True)  # fmt: skip
            save()
        if self.greedy:
            self.failures += lossless_failures(outputs)
            self.k0_outputs = self.k0_outputs or outputs.get((K0, 0, args.concurrency[0]))
            save()

    def measure_hf(self) -> None:
        row, hf_outputs = hf_plain_row(self.args, self.prompts, self.eos_token_ids)
        self.hf = row
        if self.greedy and self.k0_outputs is not None:
            self.failures += lossless_failures({(HF_PLAIN, 0, 1): hf_outputs, (K0, 0, 1): self.k0_outputs})

    def sections(self) -> dict:
        """The rows so far (medians over the rounds done) and the run's other sections."""
        rows = summarize(self.results, self.times)
        if self.hf is not None:
            rows.append(self.hf)
        add_ratios(rows)
        lossless = {"checked": self.greedy, "failures": self.failures,
                    "reference": "k0 of the same engine (k0+json under the guide)"
                                 + (", and HF generate" if self.args.hf else "")}  # fmt: skip
        guide = {"guide": json.loads(self.guide)} if self.guide is not None else {}
        return {"rows": rows, "step_times_ms": self.times, "roofline": self.floor, "lossless": lossless, **guide}

    def _proposer(self, method: str, graphs: bool):
        tree = None
        if unguided(method).endswith(TREE):
            dynamic = self.args.dynamic_tree
            tree = DynamicTree(*map(int, dynamic.split(","))) if dynamic else parse_token_tree(self.args.token_tree)
        return build_proposer(method_of(base(method)), self.args, self.max_num_seqs, self.max_model_len, graphs, tree,
                              parallel=PARALLEL in method)  # fmt: skip

    def _phase(self, method: str, verifier, proposer, prompts: list[list[int]], k: int, concurrency: int, name: str):
        """One phase of ``method``'s stages; a METHOD+suffix one with a fresh router (the phases repeat the prompts)."""
        stages = LocalStages(verifier, self.sampler, proposer)
        if suffix_first(base(method)):
            config = SuffixFirstConfig(min_score=self.args.suffix_min_score, model_num_speculative_tokens=self.args.model_k)
            stages = SuffixFirstStages(stages, SuffixFirst(config))
        layers = () if proposer is None else proposer.hidden_state_layers
        follows = unguided(method).endswith(FOLLOW)
        lengths = None
        if follows:  # what the configuration learned carries on from phase to phase, as in a server
            lengths = self.lengths.setdefault((method, k), DraftLengths(SpeculationLength(k, follows_acceptance=True)))
        params = (self.guided_params_for if guided(method) else self.params_for)[k]
        return run_phase(stages, prompts, params, concurrency, layers, self.greedy, name=name,
                         follows_acceptance=follows, lengths=lengths)  # fmt: skip


def hf_plain_row(args, prompts: list[list[int]], eos_token_ids: tuple[int, ...]) -> tuple[dict, list[list[int]]]:
    """HF ``generate`` on the same target, one prompt at a time (EOS banned until max_tokens): its row and outputs."""
    import transformers

    from bench.hf import generation_config, run_hf
    from bench.stats import latency_summary
    from bench.workload import Prompt
    from specdec.models import load_causal_lm

    transformers.utils.logging.disable_progress_bar()
    model = load_causal_lm(args.target, args.dtype, args.device)  # quiet about MTP layers the target may hold
    config = generation_config(args.max_tokens, list(eos_token_ids), ignore_eos=True)
    wrapped = [Prompt("", "", ids) for ids in prompts]
    list(run_hf(model, wrapped[:1], config, "plain"))  # warm-up
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        finished = list(run_hf(model, wrapped, config, "plain"))
        rounds.append(latency_summary([timing for timing, _ in finished], time.perf_counter() - started))
    row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"[engine] {HF_PLAIN}: {row['tokens_per_s_aggregate']:.1f} tok/s, ITL p50 {row['itl_ms_p50']:.2f} ms", flush=True)
    row = {**row, "config": HF_PLAIN, "method": None, "k": 0, "concurrency": 1, "graphs": None}
    return row, [ids for _, ids in finished]


def roofline(lm: FastCausalLM, device: str) -> dict:
    """The target's weight bytes over measured copy bandwidth: the least time a one-token step can take."""
    embedding = lm.model.model.embed_tokens.weight  # a table lookup reads a few rows, not the matrix
    total = sum(p.numel() * p.element_size() for p in lm.model.parameters()) - embedding.numel() * embedding.element_size()
    bandwidth = memory_bandwidth_gbps(device)
    return {"weight_bytes": total, "bandwidth_gbps": bandwidth, "floor_ms": floor_ms(total, bandwidth)}


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    commit, dirty = (args.commit, False) if args.commit else report.git_commit(REPO_ROOT)
    out = args.out_dir / ("engine-" + report.result_path(args.out_dir, commit).name)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run = Run(args)

    def save(complete: bool = False) -> dict:
        """Write what was measured so far: a run cut off (a time limit) keeps its finished rounds."""
        sections = run.sections()
        document = report.result_document(sections.pop("rows"), command=command, args=vars(args), commit=commit,
                                          dirty=dirty, complete=complete, **sections)  # fmt: skip
        out.write_text(json.dumps(document, indent=1, default=str))
        return document

    for graphs in args.graphs:
        run.measure(graphs, save)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.hf:
        run.measure_hf()
    document = save(complete=True)
    for line in run.failures:
        print(f"[engine] NOT LOSSLESS: {line}", flush=True)
    print(table(document["rows"]))
    print(f"[engine] wrote {out}")
    if run.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
