"""One frozen config per served model, read once from its ``config.pbtxt`` parameters.

Each ``from_parameters`` reads every key through its declaration in ``specdec_triton.parameters``
(type, default, bounds: declared once, and the docs' tables are written from them), validates
loudly (errors name the parameter and its allowed values) and rejects unknown keys, so a bad
``config.pbtxt`` fails the model load.
Paths follow ``specdec_triton.paths`` (variables expanded, then absolute or relative to the
model repository directory); the committed defaults point at the shipped pair in
``${SPECDEC_MODELS_DIR}``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from specdec.methods import HEAD, METHODS, names_of
from specdec.proposers.model_free import MODEL_FREE_METHODS
from specdec.proposers.ngram import NgramConfig
from specdec.proposers.suffix import SuffixConfig
from specdec.speculation_length import SpeculationLength, parse_per_batch_size
from specdec.suffix_first import SuffixFirstConfig
from specdec.tree import DraftTree, DynamicTree, parse_token_tree
from specdec_triton.leases import MIN_IDLE_TIMEOUT_S
from specdec_triton.parameters import SEQUENCE_IDLE_TIMEOUT_S, Reader, default
from specdec_triton.plumbing import ParameterError, Parameters

HEAD_METHODS = names_of(HEAD)  # not specdec.heads': that imports the models, which a tokenizer's process never needs

_ORCHESTRATOR = "speculative_decoding"


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_dir: str  # the target's tokenizer by default: ids must index the target's vocabulary

    @classmethod
    def from_parameters(cls, params: Parameters) -> TokenizerConfig:
        config = cls(tokenizer_dir=Reader("tokenizer", params)("tokenizer_dir"))
        params.check_all_read()
        return config


# settings only one method reads, by method: a value given under another method earns a warning
_METHOD_SETTINGS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": tuple(f"suffix_decoding_{name}" for name in SuffixConfig.__dataclass_fields__),
}

_SUFFIX_FIRST_SETTINGS = ("suffix_decoding_min_score", "model_num_speculative_tokens")  # enable_suffix_decoding's


@dataclass(frozen=True)
class DraftProposerConfig:
    method: str  # draft_model: a small LM; ngram: prompt lookup; suffix: suffix trees; eagle3, mlp_speculator: a head
    draft_model: str | None  # checkpoint (or head) directory; not read by methods ngram and suffix
    prompt_lookup_min: int | None  # ngram only; None -> vLLM's default rule
    prompt_lookup_max: int | None
    dtype: str  # auto: float32 on CPU, bfloat16 on CUDA
    engine: str  # draft_model only
    max_num_seqs: int  # draft_model only
    cpu_compile: bool = default("draft_proposer", "cpu_compile")  # on CPU, draft_model and eagle3: torch.compile
    compile_lock_timeout_s: float = default("draft_proposer", "compile_lock_timeout_s")  # a compile's wait on a lock
    suffix: SuffixConfig = SuffixConfig()  # suffix, and beside a model: vLLM's suffix_decoding_* keys
    # a model method with enable_suffix_decoding: suffix decoding first, the model where it has no strong match
    suffix_first: SuffixFirstConfig | None = None
    given: tuple[str, ...] = ()  # the method-specific settings given a value
    sequence_idle_timeout_s: float = SEQUENCE_IDLE_TIMEOUT_S.default  # 0: never reclaim
    # heads only: the target checkpoint the head drafts for (checked against it, and the
    # embedding a head without its own shares); the target_verifier's target_model
    target_model: str | None = None
    # draft_model and heads: target_verifier loads the proposer beside the target, and one call
    # proposes and verifies a step (specdec.draft_beside_target)
    run_with_target: bool = default("draft_proposer", "run_with_target")
    # draft_model and heads: tokens a sequence may hold (the cache's length); None: the checkpoint's
    # max_position_embeddings (a head: its target's). Unset, target_verifier's in the same repository
    max_model_len: int | None = None
    # model methods: the most drafts a step asks of this proposer (speculative_decoding's
    # num_speculative_tokens, or model_num_speculative_tokens behind suffix decoding); None: unknown
    most_drafts: int | None = None
    # speculative_token_tree, or speculative_eagle_topk and speculative_num_steps: the tree a head drafts
    # (specdec.tree); None: a chain
    token_tree: DraftTree | DynamicTree | None = None
    # all k drafts from one forward over mask tokens: draft_model, PARD (specdec.proposers.pard); eagle3, P-EAGLE
    # (specdec.proposers.peagle)
    parallel_drafting: bool = default("draft_proposer", "parallel_drafting")

    @classmethod
    def from_parameters(cls, params: Parameters) -> DraftProposerConfig:
        read = Reader("draft_proposer", params)
        method = read("method")
        suffix = _suffix_config(read)
        # under ngram and suffix the path is kept as written, unresolved: its variables need not be set
        draft_model = read("draft_model") if method not in MODEL_FREE_METHODS else read.text("draft_model")
        config = cls(
            method=method,
            draft_model=draft_model,
            **read.values("prompt_lookup_min", "prompt_lookup_max", "dtype", "engine", "max_num_seqs", "cpu_compile",
                          "compile_lock_timeout_s", "run_with_target"),
            suffix=suffix,
            suffix_first=_suffix_first_config(read, method, suffix),
            given=tuple(n for names in (*_METHOD_SETTINGS.values(), _SUFFIX_FIRST_SETTINGS) for n in names
                        if read.text(n) is not None),
            sequence_idle_timeout_s=_idle_timeout(read),
            target_model=_head_target(read, method),
            max_model_len=_draft_max_model_len(read, method),
            parallel_drafting=_parallel_drafting(read, method),
        )
        config = replace(config, most_drafts=_most_drafts(read, config))
        config = replace(config, token_tree=_token_tree(read, config))
        _refuse_removed_placement(params, "draft_proposer")
        params.check_all_read()
        try:
            NgramConfig.from_optional(config.prompt_lookup_min, config.prompt_lookup_max)
        except ValueError as err:
            raise ParameterError(f"draft_proposer: {err}") from None
        return config

    def unread_settings(self) -> list[str]:
        """Warnings for settings given a value that the chosen method does not read.

        Not errors: switching between methods is a one-line edit of ``method`` that
        leaves the other method's settings in place (the committed ``draft_model``
        path stays set under ``ngram``), but a value set for n-gram lookup alone
        suggests the user believes it is in use.
        """
        read_here = {self.method, "suffix"} if self.suffix_first is not None else {self.method}
        unread = [
            f"{name} is set but only method {method} reads it; method is {self.method!r}"
            for method, names in _METHOD_SETTINGS.items() if method not in read_here
            for name in names if name in self.given
        ]  # fmt: skip
        if self.suffix_first is None:
            unread += [f"{name} is set but only enable_suffix_decoding reads it; it is false"
                       for name in _SUFFIX_FIRST_SETTINGS if name in self.given]  # fmt: skip
        if self.run_with_target and self.method in MODEL_FREE_METHODS:
            unread.append(f"run_with_target changes nothing for method {self.method!r}: a model-free method runs "
                          "in speculative_decoding's process always")  # fmt: skip
        return unread

    @property
    def beside_target(self) -> bool:
        """target_verifier loads this proposer (``run_with_target``; a model-free method runs in the orchestrator)."""
        return self.run_with_target and self.method not in MODEL_FREE_METHODS


def read_draft_beside_target(repository_dir: str) -> DraftProposerConfig | None:
    """draft_proposer's settings when target_verifier's process is to load its draft model or head
    (``run_with_target``), else None (also for a repository without draft_proposer)."""
    from specdec_triton.repository_config import model_settings

    found = model_settings(repository_dir, "draft_proposer")
    if found is None or not found[0].get_bool("run_with_target", False):
        return None
    config = DraftProposerConfig.from_parameters(found[0])
    return config if config.beside_target else None


def _refuse_removed_placement(params: Parameters, model: str) -> None:
    """``run_in_orchestrator`` loaded a model in speculative_decoding's process; it was removed, since the
    placements below served as fast (docs/drafters.md#where-a-drafter-runs). A repository written before may
    still list it: false is what every model does now, true is refused with where the model runs instead."""
    if params.get_bool("run_in_orchestrator", False):
        raise ParameterError(
            f"{model}: parameter 'run_in_orchestrator' was removed: the target runs in target_verifier, a draft "
            "model or head in draft_proposer or, with draft_proposer's run_with_target: true, beside the target "
            "in target_verifier (one call a step); remove the key or set it to false"
        )


def _suffix_config(read: Reader) -> SuffixConfig:
    """vLLM's suffix_decoding_* keys; an empty value keeps vLLM's default."""
    values = {name: read(f"suffix_decoding_{name}") for name in SuffixConfig.__dataclass_fields__}
    try:
        return SuffixConfig(**values)
    except ValueError as err:
        raise ParameterError(f"draft_proposer: parameter {err}") from None


def _suffix_first_config(read: Reader, method: str, suffix: SuffixConfig) -> SuffixFirstConfig | None:
    """``enable_suffix_decoding`` (Arctic Inference's key) beside a model method, with its two settings."""
    enabled = read("enable_suffix_decoding")
    min_score = read("suffix_decoding_min_score")
    model_tokens = read("model_num_speculative_tokens")
    if not enabled:
        return None  # its two settings, if given, are warned of (unread_settings)
    if method in MODEL_FREE_METHODS:
        raise ParameterError(f"draft_proposer: enable_suffix_decoding puts suffix decoding in front of a model "
                             f"(method draft_model, {' or '.join(HEAD_METHODS)}); method is {method!r}")  # fmt: skip
    try:
        return SuffixFirstConfig(suffix, min_score, model_tokens)
    except ValueError as err:
        raise ParameterError(f"draft_proposer: parameter {err}") from None


def _parallel_drafting(read: Reader, method: str) -> bool:
    """vLLM's ``parallel_drafting``, for the methods that declare it (``specdec.methods``); refused by name for
    the others. Whether the checkpoint names a mask token is checked where it loads (``specdec_triton.drafters``)."""
    enabled = read("parallel_drafting")
    if enabled and not METHODS[method].parallel_drafting:
        able = [m.name for m in METHODS.values() if m.parallel_drafting]
        raise ParameterError(f"draft_proposer: parameter 'parallel_drafting' true is for methods {able}, not "
                             f"{method!r}")  # fmt: skip
    return enabled


def _draft_max_model_len(read: Reader, method: str) -> int | None:
    """draft_proposer's own ``max_model_len``, else target_verifier's in the same repository.

    A draft or head never holds more of a sequence than the target serves, and at a real
    model's ``max_position_embeddings`` (131072 for Llama 3) its cache and a head's feature
    buffer would take gigabytes the target's smaller window never uses. Model-free methods
    hold no cache and read none.
    """
    own = read("max_model_len")
    if own is not None or method in MODEL_FREE_METHODS or not read.params.repository_dir:
        return own
    from specdec_triton.repository_config import model_settings

    found = model_settings(read.params.repository_dir, "target_verifier")
    return None if found is None else Reader("target_verifier", found[0])("max_model_len")


def _token_tree(read: Reader, config: DraftProposerConfig) -> DraftTree | DynamicTree | None:
    """``speculative_token_tree`` (or the dynamic tree's two keys), parsed and checked against the method, the
    placement and the step's k."""
    text = read("speculative_token_tree").strip()
    topk, steps = read("speculative_eagle_topk"), read("speculative_num_steps")
    if bool(topk) != bool(steps):
        raise ParameterError("draft_proposer: parameters 'speculative_eagle_topk' and 'speculative_num_steps' make "
                             f"a dynamic tree together; got {topk} and {steps}")  # fmt: skip
    if topk and text:
        raise ParameterError("draft_proposer: parameter 'speculative_token_tree' (a static tree) and "
                             "'speculative_eagle_topk' (a dynamic one) exclude each other")  # fmt: skip
    if not text and not topk:
        return None
    method = METHODS.get(config.method)
    if method is None or not method.drafts_static_trees:
        drafting = [m.name for m in METHODS.values() if m.drafts_static_trees]
        raise ParameterError(f"draft_proposer: parameter 'speculative_token_tree' (or a dynamic tree) is for methods "
                             f"{drafting}, not {config.method!r}" + (" (suffix decoding grows its own trees: "
                             "suffix_decoding_use_tree_spec)" if config.method == "suffix" else ""))  # fmt: skip
    if topk and not method.drafts_dynamic_trees:
        dynamic = [m.name for m in METHODS.values() if m.drafts_dynamic_trees]
        raise ParameterError(f"draft_proposer: parameter 'speculative_eagle_topk' (a dynamic tree) is for methods "
                             f"{dynamic}, not {config.method!r}; a static speculative_token_tree is")  # fmt: skip
    if config.method == "eagle3" and config.parallel_drafting:
        raise ParameterError("draft_proposer: parameter 'speculative_token_tree' (or a dynamic tree) with method "
                             "'eagle3' needs parallel_drafting false (a P-EAGLE head drafts a chain in one forward); "
                             "got parallel_drafting true")  # fmt: skip
    if config.method == "draft_model" and (config.parallel_drafting or config.engine != "fast"):
        raise ParameterError("draft_proposer: parameter 'speculative_token_tree' with method 'draft_model' needs "
                             "engine 'fast' (tree passes) and parallel_drafting false (a PARD draft drafts a chain "
                             f"in one forward); got engine {config.engine!r}, parallel_drafting "
                             f"{str(config.parallel_drafting).lower()}")  # fmt: skip
    if topk:
        return DynamicTree(topk, steps)
    try:
        return parse_token_tree(text, config.most_drafts)
    except ValueError as err:
        raise ParameterError(f"draft_proposer: parameter {err}" + (
            " (speculative_decoding's num_speculative_tokens)" if "num_speculative_tokens" in str(err) else ""
        )) from None  # fmt: skip


def _most_drafts(read: Reader, config: DraftProposerConfig) -> int | None:
    """The most drafts one step asks of a model method, read from speculative_decoding in the same repository,
    so that a head with fewer stages than that is refused when it loads, not at each request."""
    if config.method in MODEL_FREE_METHODS:
        return None
    if config.suffix_first is not None and config.suffix_first.model_num_speculative_tokens:
        return config.suffix_first.model_num_speculative_tokens
    if not read.params.repository_dir:
        return None
    from specdec_triton.repository_config import model_settings

    found = model_settings(read.params.repository_dir, "speculative_decoding")
    return None if found is None else Reader("speculative_decoding", found[0])("num_speculative_tokens")


def _head_target(read: Reader, method: str) -> str | None:
    """The checkpoint a head drafts for: draft_proposer's own ``target_model`` when set, else
    target_verifier's in the same repository (the checkpoint the server verifies with), so a
    repository names its target once. Methods without a head read none."""
    if method not in HEAD_METHODS:
        read.text("target_model")  # read, so that a value left from a head method is no unknown key
        return None
    own = read("target_model")
    if own is not None:
        return own
    from specdec_triton.repository_config import model_settings

    params = read.params
    found = model_settings(params.repository_dir, "target_verifier") if params.repository_dir else None
    if found is None:  # read outside a repository: the default target_verifier itself would serve
        return params.get_path("target_model", default("target_verifier", "target_model"))
    return TargetVerifierConfig.from_parameters(found[0]).target_model


@dataclass(frozen=True)
class TargetVerifierConfig:
    target_model: str  # checkpoint directory
    dtype: str
    max_model_len: int | None  # prompt + output tokens; None -> the model's max_position_embeddings
    engine: str
    max_num_seqs: int  # the orchestrator admits no more sequences than this at once
    cpu_compile: bool = default("target_verifier", "cpu_compile")  # fast engine on CPU: torch.compile
    compile_lock_timeout_s: float = default("target_verifier", "compile_lock_timeout_s")  # a compile's wait on a lock
    sequence_idle_timeout_s: float = SEQUENCE_IDLE_TIMEOUT_S.default  # 0: never reclaim

    @classmethod
    def from_parameters(cls, params: Parameters) -> TargetVerifierConfig:
        read = Reader("target_verifier", params)
        config = cls(
            **read.values("target_model", "dtype", "max_model_len", "engine", "max_num_seqs", "cpu_compile",
                          "compile_lock_timeout_s"),
            sequence_idle_timeout_s=_idle_timeout(read),
        )
        _refuse_removed_placement(params, "target_verifier")
        params.check_all_read()
        return config


def _idle_timeout(read: Reader) -> float:
    """0 (never reclaim) or at least three renewal intervals (specdec_triton.leases), so that a live request's
    sequence, renewed every RENEW_INTERVAL_S, is never taken between two renewals."""
    timeout = read(SEQUENCE_IDLE_TIMEOUT_S.name)
    if 0 < timeout < MIN_IDLE_TIMEOUT_S:
        raise read.params.invalid(SEQUENCE_IDLE_TIMEOUT_S.name, f"{timeout:g}", SEQUENCE_IDLE_TIMEOUT_S.allowed)
    return timeout


@dataclass(frozen=True)
class RejectionSamplerConfig:
    method: str  # probabilistic (lossless), strict (lossless, no q), synthetic (benchmarking only)
    synthetic_acceptance_rate: float  # read by method synthetic only
    use_triton_kernel: bool  # the Triton kernel instead of the torch path; needs a GPU instance

    @classmethod
    def from_parameters(cls, params: Parameters) -> RejectionSamplerConfig:
        read = Reader("rejection_sampler", params)
        config = cls(
            method=read("rejection_sample_method"),
            synthetic_acceptance_rate=read("synthetic_acceptance_rate"),
            use_triton_kernel=read("use_triton_kernel"),
        )
        params.check_all_read()
        return config


@dataclass(frozen=True)
class OrchestratorConfig:
    num_speculative_tokens: int  # k by default, and the most a request may ask for
    default_max_tokens: int  # when a request sends no max_tokens
    # the most drafts a step allows, by the number of sequences in it; under it, whether each
    # sequence's k follows its acceptance (speculation_follows_acceptance)
    speculation: SpeculationLength
    # request parameters (forwarded headers) accepted and left unread; any other one is refused
    ignored_request_parameters: re.Pattern | None = None
    on_stub_failure: str = default(_ORCHESTRATOR, "on_stub_failure")  # a composing model's process died: reload | stop
    health_check_interval_s: float = default(_ORCHESTRATOR, "health_check_interval_s")
    max_request_seconds: float = default(_ORCHESTRATOR, "max_request_seconds")  # then cancelled; 0: no limit
    # the request parameter naming the client (a header the gateway sets and Triton forwards); None: not named
    client_id_parameter: str | None = default(_ORCHESTRATOR, "client_id_parameter")
    max_sequences_per_client: int = default(_ORCHESTRATOR, "max_sequences_per_client")  # in flight; 0: no limit
    # how a step calls the models holding sequences: socket (specdec_triton.socket_calls, ~0.4 ms a call) | bls
    stage_calls: str = default(_ORCHESTRATOR, "stage_calls")

    @classmethod
    def from_parameters(cls, params: Parameters) -> OrchestratorConfig:
        read = Reader(_ORCHESTRATOR, params)
        k = read("num_speculative_tokens")
        table = read("num_speculative_tokens_per_batch_size")
        try:
            speculation = SpeculationLength(
                num_speculative_tokens=k,
                per_batch_size=parse_per_batch_size(table),
                disable_by_batch_size=read("speculative_disable_by_batch_size"),
                follows_acceptance=read("speculation_follows_acceptance"),
            )
        except ValueError as err:
            raise ParameterError(f"speculative_decoding: parameter 'num_speculative_tokens_per_batch_size' {err}") from None
        config = cls(
            num_speculative_tokens=k,
            speculation=speculation,
            **read.values("default_max_tokens", "ignored_request_parameters", "on_stub_failure",
                          "health_check_interval_s", "max_request_seconds", "client_id_parameter",
                          "max_sequences_per_client", "stage_calls"),
        )
        read("speculative_config")  # vLLM's JSON: every model applied it to its own keys while loading
        params.check_all_read()
        return config
