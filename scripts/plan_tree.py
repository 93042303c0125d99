#!/usr/bin/env python3
"""Plan a static draft tree for this machine: measure how often each path is accepted and what a step
costs, then print the fastest tree of each size (``specdec.tree_plan``) as a ``speculative_token_tree``.

1. **Acceptance**: the drafter drafts a large measurement tree (every path up to
   ``--max-depth`` of ranks below ``--max-rank`` that leaves the top choice at most
   ``--max-off-top`` times) on held-out prompts, greedy, and each step's accepted path is
   counted. The prompts are drawn with ``--seed`` (default 1), apart from the files the
   benchmarks' default prompts (seed 0) come from, so a planned tree is not fitted to the
   prompts it is then benchmarked on.
2. **Cost**: k = 0, chains of 1..``--max-depth`` and a few wide trees decode the same
   prompts, one stream, rounds interleaved; a step's median cost is fitted as a line in
   the tree's nodes and depth (``StepCost.fit``). Each timed shape's measured tokens/s is
   printed beside what the fit and the rates predict for it, the model's own check.
3. **Plan**: the fastest tree of each size up to ``--max-nodes``, against the best chain.

The engine is ``scripts/benchmark_engine.py``'s (``bench.engine``), so a planned tree can be
checked there: ``--configs k0,eagle3:3,eagle3+tree:N --token-tree "<the plan's tree>"``.
On CUDA the target and the drafter replay CUDA graphs where they would served (a chain's steps;
a tree's passes run eagerly). Writes ``benchmarks/results/plan-tree-<UTC date-time>-<commit>.json``.

    python scripts/plan_tree.py --method eagle3 --max-nodes 12
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from bench import report  # noqa: E402
from bench.engine import LocalStages, build_proposer, run_phase  # noqa: E402
from bench.workload import held_out_texts, select_prompts  # noqa: E402
from specdec.engine import GenerationParams  # noqa: E402
from specdec.fast import FastCausalLM  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402
from specdec.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402
from specdec.tree import DraftTree, chain, parse_token_tree  # noqa: E402
from specdec.tree_plan import PathAcceptance, StepCost, best_chain, best_trees, measurement_tree, plan  # noqa: E402
from specdec.verifier import TargetVerifier  # noqa: E402

TREE_METHODS = ("eagle3", "medusa", "mlp_speculator", "draft_model")
# shapes timed beside the chains: wider than deep, so that a node's cost and a level's can be told apart
WIDE_SHAPES = ("[(0,), (1,), (2,), (3,)]", "[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]",
               "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=TREE_METHODS, default="eagle3")
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--eagle3", type=Path, default=REPO_ROOT / "models" / "tiny-eagle3")
    p.add_argument("--mlp-speculator", type=Path, default=REPO_ROOT / "models" / "tiny-mlp-speculator")
    p.add_argument("--medusa", type=Path, default=REPO_ROOT / "models" / "tiny-medusa")
    p.add_argument("--max-depth", type=int, default=5, help="measurement tree: deepest path (the heads' stages cap it)")
    p.add_argument("--max-rank", type=int, default=4, help="measurement tree: ranks below this at every depth")
    p.add_argument("--max-off-top", type=int, default=2, help="measurement tree: ranks other than 0 on a path")
    p.add_argument("--max-nodes", type=int, default=12, help="the largest tree planned")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed shapes interleaved, medians over rounds")
    p.add_argument("--seed", type=int, default=1, help="prompt selection; the benchmarks' prompts are seed 0's")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--best-out", type=Path, default=None,
                   help="also write the fastest tree here: its node count on one line, its tree on the next")
    return p.parse_args()


def plan_prompts(args, tokenizer) -> list[list[int]]:
    """Held-out prompts of ``args.seed``, none from a file the benchmarks' seed-0 prompts come from."""
    texts = held_out_texts()
    encode = lambda t: tokenizer(t)["input_ids"]  # noqa: E731
    benchmarked = {p.source.split(":")[0] for p in select_prompts(texts, encode, 8, args.prompt_tokens, 0)}
    texts = {name: text for name, text in texts.items() if name not in benchmarked}
    return [p.token_ids for p in select_prompts(texts, encode, args.num_prompts, args.prompt_tokens, args.seed)]


class RecordingSampler:
    """The rejection sampler, keeping each tree step's accepted nodes."""

    def __init__(self, sampler: RejectionSampler, num_nodes: int):
        self.sampler, self.num_nodes, self.accepted = sampler, num_nodes, []

    def __call__(self, draft_token_ids, draft_probs, verify, seed, method=None, position=None, parents=None):
        result = self.sampler(draft_token_ids, draft_probs, verify, seed, method, position, parents)
        if parents is not None and len(parents) == self.num_nodes:  # a step near the end, cut, is not counted
            self.accepted.append(result.accepted_nodes)
        return result


class Planner:
    def __init__(self, args):
        self.args = args
        tokenizer = load_tokenizer(args.target)
        self.prompts = plan_prompts(args, tokenizer)
        self.measured = measurement_tree(args.max_depth, args.max_rank, args.max_off_top)
        self.timed_shapes()  # refused before a measurement, not after it
        # the measurement decodes past --max-tokens by the tree's size: a step drafts no more nodes than tokens are
        # left, so its first --max-tokens tokens draft the whole tree and the rest (uncounted) a cut of it
        self.max_model_len = max(map(len, self.prompts)) + args.max_tokens + 2 * self.measured.num_nodes + 8
        # on CUDA the chains' steps replay captured graphs as served; a tree's passes run eagerly either way
        self.graphs = args.device != "cpu"
        self.lm = FastCausalLM(args.target, args.dtype, args.device, 4, self.max_model_len, cuda_graphs=self.graphs)
        self.verifier = TargetVerifier(self.lm)
        self.eos = tuple(eos_token_ids(tokenizer, args.target))

    def params(self, k: int, extra_tokens: int = 0) -> GenerationParams:
        tokens = self.args.max_tokens + extra_tokens
        return GenerationParams(max_tokens=tokens, min_tokens=tokens, eos_token_ids=self.eos,
                                num_speculative_tokens=k)  # fmt: skip

    def proposer(self, tree: DraftTree | None):
        return build_proposer(self.args.method, self.args, 4, self.max_model_len, self.graphs, tree)

    def acceptance(self) -> PathAcceptance:
        tree = self.measured
        print(f"[plan] measuring acceptance over a {tree.num_nodes}-node tree, {len(self.prompts)} prompts", flush=True)
        proposer = self.proposer(tree)
        recording = RecordingSampler(RejectionSampler("strict", 0.0), tree.num_nodes)
        run_phase(LocalStages(self.verifier, recording, proposer), self.prompts, self.params(tree.num_nodes, tree.num_nodes),
                  4,
                  proposer.hidden_state_layers, match_greedy_here=False, name="measure")  # fmt: skip
        return PathAcceptance.from_steps(tree, recording.accepted)

    def timed_shapes(self) -> list[DraftTree | None]:
        """k = 0, the chains, and the wide shapes the measurement tree holds (their rates are known)."""
        depth = min(self.args.max_depth, 5)
        wide = [t for t in map(parse_token_tree, WIDE_SHAPES) if set(t.paths) <= set(self.measured.paths)]
        if not wide:
            raise SystemExit(f"none of the wide shapes {WIDE_SHAPES} fits a measurement tree of depth "
                             f"{self.args.max_depth} and ranks below {self.args.max_rank}: a step's cost per node "
                             "cannot be told from its cost per level")  # fmt: skip
        return [None, *(chain(k) for k in range(1, depth + 1)), *wide]

    def costs(self) -> tuple[StepCost, list[dict]]:
        """Each timed shape's median step seconds and tokens/s at one stream, and the line fitted to them."""
        shapes = self.timed_shapes()
        stages = [LocalStages(self.verifier, RejectionSampler("strict", 0.0), self.proposer(t) if t else None)
                  for t in shapes]  # fmt: skip
        rounds: list[list[tuple[float, float, float]]] = [[] for _ in shapes]
        for r in range(-1, self.args.rounds):  # round -1 warms every shape up, unmeasured
            order = list(range(len(shapes)))[:: 1 if r % 2 == 0 else -1]
            for i in order:
                k = 0 if shapes[i] is None else shapes[i].num_nodes
                prompts = self.prompts[:1] if r < 0 else self.prompts
                phase = run_phase(stages[i], prompts, self.params(k), 1, self._layers(stages[i]), name=f"t{r}")
                if r >= 0:
                    tokens = sum(map(len, phase.outputs))
                    rounds[i].append((phase.elapsed_s / len(phase.steps), tokens / phase.elapsed_s,
                                      tokens / len(phase.steps)))  # fmt: skip
            if r >= 0:
                print(f"[plan] timing round {r + 1}/{self.args.rounds} done", flush=True)
        rows = []
        for tree, measured in zip(shapes, rounds):
            rows.append({"tree": None if tree is None else tree.spec(),
                         "num_nodes": 0 if tree is None else tree.num_nodes,
                         "depth": 0 if tree is None else tree.max_depth,
                         "step_s": statistics.median(s for s, _, _ in measured),
                         "tokens_per_s": statistics.median(t for _, t, _ in measured),
                         # the prefill steps and the cut steps at each request's end included
                         "tokens_per_step": statistics.median(n for _, _, n in measured)})  # fmt: skip
        return StepCost.fit([(r["num_nodes"], r["depth"], r["step_s"]) for r in rows]), rows

    @staticmethod
    def _layers(stages: LocalStages) -> tuple[int, ...]:
        return () if stages.proposer is None else stages.proposer.hidden_state_layers


def plan_row(p, chain_plan) -> dict:
    return {"tree": None if p.tree is None else p.tree.spec(), "num_nodes": p.num_nodes,
            "depth": 0 if p.tree is None else p.tree.max_depth, "tokens_per_step": p.tokens_per_step,
            "step_ms": 1e3 * p.step_s, "x_chain": p.tokens_per_s / chain_plan.tokens_per_s}  # fmt: skip


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    planner = Planner(args)
    acceptance = planner.acceptance()
    cost, timed = planner.costs()
    print(f"[plan] step cost: fixed {1e3 * cost.fixed_s:.2f} ms, call {1e3 * cost.call_s:.2f} ms, "
          f"depth {1e3 * cost.depth_s:.2f} ms, node {1e3 * cost.node_s:.2f} ms")  # fmt: skip
    k0 = plan(None, acceptance, cost)
    for row in timed:
        tree = None if row["tree"] is None else parse_token_tree(row["tree"])
        predicted = plan(tree, acceptance, cost)
        row["predicted_tokens_per_s"] = predicted.tokens_per_s
        row["predicted_tokens_per_step"] = predicted.tokens_per_step
        print(f"[plan] timed {row['tree'] or 'k = 0'}: {row['tokens_per_s']:.1f} tok/s and {row['tokens_per_step']:.2f} "
              f"tokens/step measured, {predicted.tokens_per_s:.1f} and {predicted.tokens_per_step:.2f} predicted")  # fmt: skip
    chain_plan = best_chain(acceptance, cost, args.max_depth)
    plans = best_trees(acceptance, cost, args.max_nodes)
    print(f"\nbest chain: k = {chain_plan.num_nodes}, {chain_plan.tokens_per_step:.2f} tokens/step, "
          f"{chain_plan.tokens_per_s / k0.tokens_per_s:.2f}x k = 0 (predicted)")  # fmt: skip
    print("| nodes | depth | tokens/step | step ms | x best chain | tree |\n|---|---|---|---|---|---|")
    rows = [plan_row(p, chain_plan) for p in plans]
    for r in rows:
        print(f"| {r['num_nodes']} | {r['depth']} | {r['tokens_per_step']:.2f} | {r['step_ms']:.2f} | "
              f"{r['x_chain']:.2f}x | `{r['tree']}` |")  # fmt: skip
    best = max(plans, key=lambda p: p.tokens_per_s)
    print(f"\nfastest: {best.num_nodes} nodes, {best.tokens_per_s / chain_plan.tokens_per_s:.2f}x the best chain "
          f"(predicted): --token-tree \"{best.tree.spec()}\"")  # fmt: skip
    commit, _ = report.git_commit(REPO_ROOT)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / ("plan-tree-" + report.result_path(args.out_dir, commit).name)
    out.write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "commit": commit, "args": {k: str(v) for k, v in vars(args).items()},
        "measurement_tree_nodes": planner.measured.num_nodes, "steps_measured": acceptance.steps,
        "path_rates": {str(p): acceptance.rate(p) for p in acceptance.counts if acceptance.counts[p]},
        "step_cost": dataclasses.asdict(cost), "timed": timed, "best_chain": plan_row(chain_plan, chain_plan),
        "plans": rows,
    }, indent=1))
    print(f"[plan] wrote {out}")
    if args.best_out is not None:
        args.best_out.write_text(f"{best.num_nodes}\n{best.tree.spec()}\n")


if __name__ == "__main__":
    main()
