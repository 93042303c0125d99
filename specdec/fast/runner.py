"""One Llama-family model, its static KV cache and (on CUDA) its captured graphs: the fast engine core.

``FastCausalLM`` keeps the ``specdec.cached_lm.CachedLM`` contract, as the generic
``specdec.models.CachedCausalLM`` does -- each call names a ``seq_id``, the ``position`` of
its first token and how many trailing logits it wants; a position below the cached
length rolls the cache back to it -- but runs a whole list of calls as one ragged,
right-padded batch. The target verifier and the draft proposer each own one.
"""
from __future__ import annotations

import os

import torch

from specdec.cached_lm import ForwardCall, check_forward_calls
from specdec.compile_locks import compile_phase
from specdec.fast.cpu_compile import compile_forward, warm_up
from specdec.fast.cuda_graphs import DEFAULT_GRAPH_NUM_TOKENS, CudaGraphRunner, StaticShapeRunner
from specdec.fast.kv_cache import StaticKVCache
from specdec.fast.llama import TreeAttention, check_hidden_layers, default_triton_attention, load_fast_llama
from specdec.models import resolve_dtype
from specdec.progress import Log, timed_phase
from specdec.tree import node_depths, tree_visibility


PAD_SLACK_TOKENS = 32  # padding a pass may always carry, however few its real tokens
PAD_SLACK_FRACTION = 0.25  # and padding it may carry relative to its real tokens


def padding_bounded_passes(lengths: list[int]) -> list[list[int]]:
    """Split a ragged batch into passes whose right-padding stays within bounds; indices into ``lengths``.

    A pass pads every row to its longest, so one prefill of 135 tokens next to three
    5-token verifications would run 540 token positions for 150 real ones (73 ms against
    21 + 7 ms in two passes, tiny target on CPU). Calls are taken shortest first, and a
    call starts a new pass when joining would pad more than ``PAD_SLACK_TOKENS`` and more
    than ``PAD_SLACK_FRACTION`` of the pass's real tokens: same-length decode steps always
    share a pass, and so do prefills of similar length.
    """
    passes: list[list[int]] = []
    group: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        padded = (len(group) + 1) * lengths[i]  # the longest so far, since calls come shortest first
        waste = padded - (real + lengths[i])
        if group and waste > max(PAD_SLACK_TOKENS, PAD_SLACK_FRACTION * (real + lengths[i])):
            passes.append(group)
            group, real = [], 0
        group.append(i)
        real += lengths[i]
    if group:
        passes.append(group)
    return passes


def tree_attention(calls: list[ForwardCall], width: int, device: torch.device) -> TreeAttention | None:
    """Who sees whom in a pass that holds a draft tree (``ForwardCall.tree_parents``); None for chains alone.

    A chain's or a prompt's tokens see those before them, as without a tree; a tree's root
    (``token_ids[0]``) sees the cache, and each node the root and its ancestors, rotating at
    the root's position plus its depth.
    """
    if all(c.tree_parents is None for c in calls):
        return None
    visible = torch.ones(len(calls), width, width, dtype=torch.bool).tril_()  # [B, S, S]: causal by default
    depths = torch.arange(width).repeat(len(calls), 1)  # [B, S]
    for i, call in enumerate(calls):
        if call.tree_parents is not None:
            n = len(call.tree_parents) + 1
            visible[i, :n] = tree_visibility(call.tree_parents, width)
            depths[i, 1:n] = torch.tensor(node_depths(call.tree_parents))
    base = torch.tensor([c.position for c in calls], dtype=torch.long)  # [B]
    to = dict(device=device, non_blocking=True)
    return TreeAttention(base.to(**to), (base[:, None] + depths).to(**to), visible.to(**to))


class FastCausalLM:
    def __init__(
        self,
        path: str | os.PathLike,
        dtype: str = "auto",
        device: str | torch.device = "cpu",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
        *,
        graph_num_tokens: tuple[int, ...] = DEFAULT_GRAPH_NUM_TOKENS,
        triton_attention: bool | None = None,
        cpu_compile: bool = False,
        log: Log | None = None,
        warm_trees: bool = False,
    ):
        """``cpu_compile``: run the forward compiled by ``torch.compile`` (``cpu_compile.py``), CPU only.

        ``triton_attention``: attention by the Triton slot kernel; None: on CUDA
        (``specdec.fast.llama.default_triton_attention`` says why). ``warm_trees``: with ``cpu_compile``,
        compile draft trees' passes at load too (``cpu_compile.warm_up``).
        """
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={str(self.device)!r}")
        if cpu_compile and self.device.type != "cpu":
            raise ValueError(f"cpu_compile is for CPU devices (CUDA captures graphs instead), got device={str(self.device)!r}")
        if triton_attention is None:
            triton_attention = default_triton_attention(self.device)
        with timed_phase(log, f"loading weights of {path} to {self.device}"):
            self.model = load_fast_llama(path, resolve_dtype(dtype, self.device), self.device, triton_attention)
        config = self.model.config
        self.max_model_len = max_model_len if max_model_len is not None else config.max_position_embeddings
        config.check_max_model_len(self.max_model_len)
        with timed_phase(log, f"allocating the KV cache ({max_num_seqs} sequences x {self.max_model_len} tokens)"):
            self.cache = StaticKVCache(
                config.num_layers, config.num_kv_heads, config.head_dim, max_num_seqs, self.max_model_len,
                self.model.dtype, self.device,
            )
        self._forward = self.model  # what an eager-shaped pass calls: the module, or its compiled forward
        self.graphs: StaticShapeRunner | None = None  # passes that want logits alone
        self._graphs_with_hidden: dict[tuple[int, ...], StaticShapeRunner] = {}  # hidden_layers -> their runner
        self._compiled_hidden: set[tuple[int, ...]] = set()  # hidden_layers whose compiled passes are warm
        self._log = log
        self._warm_trees = warm_trees
        self._path = path
        if cpu_compile:
            with compile_phase(log, f"compiling the forward of {path} for CPU") as progress:
                # the cache's sizes never change: as symbols, one equal to a pass's token count (6 layers, a
                # 6-token tree) would be taken for the same symbol, and the next pass of another size recompile
                torch._dynamo.mark_static(self.cache.kv)
                self._forward = compile_forward(self.model)
                warm_up(self, trees=warm_trees, progress=progress)
        use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if use_graphs:
            with timed_phase(log, f"capturing CUDA graphs (token counts {list(graph_num_tokens)})"):
                self.graphs = CudaGraphRunner(self.model, self.cache, graph_num_tokens)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def num_active_sequences(self) -> int:
        return self.cache.num_active

    def cached_length(self, seq_id: str) -> int:
        return self.cache.length(seq_id)

    def release(self, seq_id: str) -> None:
        self.cache.release(seq_id)

    def forward(self, calls: list[ForwardCall]) -> list[torch.Tensor]:  # each [num_logits, vocab] float32
        """Run the calls as batched passes (one, unless lengths differ widely: ``padding_bounded_passes``).

        A failure leaves each sequence at its ``position``.
        """
        return self.forward_with_hidden(calls, ())[0]

    @torch.inference_mode()
    def forward_with_hidden(
        self, calls: list[ForwardCall], hidden_layers: tuple[int, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``forward``, and per call the hidden states ``hidden_layers`` of every token it fed.

        Each hidden tensor is ``[len(token_ids), len(hidden_layers) * hidden]`` in the model
        dtype, on the model's device (None without ``hidden_layers``).
        """
        if not calls:
            return [], []
        check_hidden_layers(hidden_layers, self.model.config.num_layers)
        if hidden_layers and self._forward is not self.model and hidden_layers not in self._compiled_hidden:
            self._warm_up_hidden(hidden_layers)
        fresh = [c.seq_id for c in calls if c.seq_id not in self.cache]
        check_forward_calls(self, calls, len(fresh))
        for call in calls:
            if call.seq_id in self.cache:
                self.cache.move(call.seq_id, call.moves)  # an accepted tree path, to the positions of its depths
                self.cache.set_length(call.seq_id, call.position)  # rollback: only a length moves
            else:
                self.cache.allocate(call.seq_id)
        try:
            logits: list[torch.Tensor | None] = [None] * len(calls)
            hidden: list[torch.Tensor | None] = [None] * len(calls)
            for group in padding_bounded_passes([len(c.token_ids) for c in calls]):
                rows, states = self._run([calls[i] for i in group], hidden_layers)
                for j, i in enumerate(group):
                    logits[i], hidden[i] = rows[j], states[j]
        except BaseException:
            for seq_id in fresh:
                self.cache.release(seq_id)
            raise
        for call in calls:
            self.cache.set_length(call.seq_id, call.position + len(call.token_ids))
        return logits, hidden

    def _warm_up_hidden(self, hidden_layers: tuple[int, ...]) -> None:
        """Compile every pass shape that exports ``hidden_layers`` at once, as the load did for plain passes.

        The layers come with a head's first verify; left to the passes that meet them, the
        compiles (a second or more each) land one by one on the first requests' steps.
        """
        self._compiled_hidden.add(hidden_layers)  # first: warm_up's own passes come back through here
        what = f"compiling the forward of {self._path} with hidden states {list(hidden_layers)}"
        with compile_phase(self._log, what) as progress:
            warm_up(self, hidden_layers, self._warm_trees, progress)

    def _graphs_for(self, hidden_layers: tuple[int, ...]) -> StaticShapeRunner | None:
        """The fixed-shape runner for passes that want ``hidden_layers``; None where passes run eagerly.

        A head reads the same layers every step, so the first pass that asks for a set of
        layers captures its graphs (once, about as long as the load's capture) and every
        later verify of that head replays them.
        """
        if self.graphs is None or not hidden_layers:
            return self.graphs
        runner = self._graphs_with_hidden.get(hidden_layers)
        if runner is None:
            with timed_phase(self._log, f"capturing CUDA graphs with hidden states {list(hidden_layers)}"):
                extra = {"pool": self.graphs.pool} if isinstance(self.graphs, CudaGraphRunner) else {}
                runner = type(self.graphs)(self.model, self.cache, self.graphs.num_tokens, hidden_layers, **extra)
            self._graphs_with_hidden[hidden_layers] = runner
        return runner

    def _run(
        self, calls: list[ForwardCall], hidden_layers: tuple[int, ...] = ()
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        b, s = len(calls), max(len(c.token_ids) for c in calls)
        input_ids = torch.zeros((b, s), dtype=torch.long)  # [B, S], right-padded
        for i, call in enumerate(calls):
            input_ids[i, : len(call.token_ids)] = torch.tensor(call.token_ids, dtype=torch.long)
        starts = torch.tensor([c.position for c in calls], dtype=torch.long)  # [B]
        num_new = torch.tensor([len(c.token_ids) for c in calls], dtype=torch.long)  # [B]
        slots = torch.tensor([self.cache.slot(c.seq_id) for c in calls], dtype=torch.long)  # [B]
        tree = tree_attention(calls, s, self.device)
        graphs = self._graphs_for(hidden_layers) if tree is None else None  # a tree pass runs eagerly
        bucket = graphs.bucket(b, s) if graphs is not None else None
        width = bucket[1] if bucket is not None else s  # padded tokens per row of the pass that runs
        rows = torch.tensor(
            [i * width + len(c.token_ids) - c.num_logits + j for i, c in enumerate(calls) for j in range(c.num_logits)],
            dtype=torch.long, device=self.device,
        )  # [R]: flattened [B, width] indices of the wanted logits
        hidden_rows = torch.tensor(
            [i * width + j for i, c in enumerate(calls) for j in range(len(c.token_ids))],
            dtype=torch.long, device=self.device,
        ) if hidden_layers else None  # [N]: every token fed
        hidden = None
        if bucket is not None:
            all_logits, all_hidden = graphs.run(bucket, input_ids, starts, num_new, slots)  # every row of the bucket
            logits = all_logits.index_select(0, rows)  # [R, vocab]
            if hidden_layers:
                hidden = all_hidden.index_select(0, hidden_rows)  # [N, n * hidden]
        else:
            kv_len = int((starts + num_new).max())
            to = dict(device=self.device, non_blocking=True)
            out = self._forward(
                input_ids.to(**to), starts.to(**to), num_new.to(**to), slots.to(**to),
                self.cache.kv, kv_len=kv_len, logit_rows=rows, hidden_layers=hidden_layers, hidden_rows=hidden_rows,
                tree=tree,
            )  # [R, vocab], or ([R, vocab], [N, n * hidden])
            logits, hidden = out if hidden_layers else (out, None)
        logits = list(logits.float().split([c.num_logits for c in calls]))
        if hidden is None:
            return logits, [None] * len(calls)
        return logits, list(hidden.split([len(c.token_ids) for c in calls]))
