"""One frozen config per served model, read once from its ``config.pbtxt`` parameters.

Each ``from_parameters`` validates loudly (errors name the parameter and its allowed
values) and rejects unknown keys, so a bad ``config.pbtxt`` fails the model load.
Paths follow ``specdec_triton.paths`` (variables expanded, then absolute or relative to the
model repository directory); the committed defaults point at the shipped pair in
``${SPECDEC_MODELS_DIR}``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from specdec.build import ENGINES
from specdec.heads import HEAD_METHODS
from specdec.models import DTYPE_CHOICES
from specdec.proposers import PROPOSERS
from specdec.proposers.model_free import MODEL_FREE_METHODS
from specdec.proposers.ngram import NgramConfig
from specdec.proposers.suffix import SuffixConfig
from specdec.rejection_sampler import METHODS
from specdec.speculation_length import SpeculationLength, parse_per_batch_size
from specdec.suffix_first import DEFAULT_MIN_SCORE, SuffixFirstConfig
from specdec_triton.leases import MIN_IDLE_TIMEOUT_S
from specdec_triton.plumbing import ParameterError, Parameters
from specdec_triton.speculative_config import PARAMETER
from specdec_triton.recovery import ON_STUB_FAILURE

DEFAULT_TARGET_MODEL = "${SPECDEC_MODELS_DIR}/tiny-target"  # scripts/serve.sh sets it to <checkout>/models
DEFAULT_DRAFT_MODEL = "${SPECDEC_MODELS_DIR}/tiny-draft"
# ENGINES (specdec.build) fast: Llama-family checkpoints, every sequence of a dynamic batch in one forward
# over a static slot KV cache (CUDA graphs on GPU); hf: any AutoModelForCausalLM, one sequence at a time.
DEFAULT_MAX_NUM_SEQS = 8  # sequences held at once: KV-cache slots of the fast engine
# A live request's sequence is renewed every few seconds (specdec_triton.leases), so one untouched this
# long was lost by its caller (a failed release): its slot is reclaimed.
DEFAULT_SEQUENCE_IDLE_TIMEOUT_S = 120.0
STAGE_CALLS = ("socket", "bls")  # speculative_decoding's stage_calls


@dataclass(frozen=True)
class TokenizerConfig:
    tokenizer_dir: str  # the target's tokenizer by default: ids must index the target's vocabulary

    @classmethod
    def from_parameters(cls, params: Parameters) -> TokenizerConfig:
        config = cls(tokenizer_dir=params.get_path("tokenizer_dir", DEFAULT_TARGET_MODEL))
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
    cpu_compile: bool = False  # on CPU, draft_model (fast engine) and eagle3: the forward compiled by torch.compile
    suffix: SuffixConfig = SuffixConfig()  # suffix, and beside a model: vLLM's suffix_decoding_* keys
    # a model method with enable_suffix_decoding: suffix decoding first, the model where it has no strong match
    suffix_first: SuffixFirstConfig | None = None
    given: tuple[str, ...] = ()  # the method-specific settings given a value
    sequence_idle_timeout_s: float = DEFAULT_SEQUENCE_IDLE_TIMEOUT_S  # 0: never reclaim
    # heads only: the target checkpoint the head drafts for (checked against it, and the
    # embedding a head without its own shares); the target_verifier's target_model
    target_model: str | None = None
    # draft_model and heads: target_verifier loads the proposer beside the target, and one call
    # proposes and verifies a step (specdec.draft_beside_target)
    run_with_target: bool = False
    # draft_model and heads: tokens a sequence may hold (the cache's length); None: the checkpoint's
    # max_position_embeddings (a head: its target's). Unset, target_verifier's in the same repository
    max_model_len: int | None = None

    @classmethod
    def from_parameters(cls, params: Parameters) -> DraftProposerConfig:
        method = params.get_str("method", "draft_model", choices=tuple(PROPOSERS))
        suffix = _suffix_config(params)
        # under ngram and suffix the path is kept as written, unresolved: its variables need not be set
        draft_model = (params.get_path("draft_model", DEFAULT_DRAFT_MODEL) if method not in MODEL_FREE_METHODS
                       else params.get_str("draft_model", None))  # fmt: skip
        config = cls(
            method=method,
            draft_model=draft_model,
            prompt_lookup_min=params.get_int("prompt_lookup_min", None, minimum=1),
            prompt_lookup_max=params.get_int("prompt_lookup_max", None, minimum=1),
            dtype=params.get_str("dtype", "auto", choices=DTYPE_CHOICES),
            engine=params.get_str("engine", "fast", choices=ENGINES),
            max_num_seqs=params.get_int("max_num_seqs", DEFAULT_MAX_NUM_SEQS, minimum=1),
            cpu_compile=params.get_bool("cpu_compile", False),
            suffix=suffix,
            suffix_first=_suffix_first_config(params, method, suffix),
            given=tuple(n for names in (*_METHOD_SETTINGS.values(), _SUFFIX_FIRST_SETTINGS) for n in names
                        if params.get_str(n, "") != ""),
            sequence_idle_timeout_s=_idle_timeout(params),
            target_model=_head_target(params, method),
            run_with_target=params.get_bool("run_with_target", False),
            max_model_len=_draft_max_model_len(params, method),
        )
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


def _refuse_removed_placement(params: Parameters, model: str) -> None:
    """``run_in_orchestrator`` loaded a model in speculative_decoding's process; it was removed, since the
    placements below served as fast (docs/serving.md). A repository written before may still list it:
    false is what every model does now, true is refused with where the model runs instead."""
    if params.get_bool("run_in_orchestrator", False):
        raise ParameterError(
            f"{model}: parameter 'run_in_orchestrator' was removed: the target runs in target_verifier, a draft "
            "model or head in draft_proposer or, with draft_proposer's run_with_target: true, beside the target "
            "in target_verifier (one call a step); remove the key or set it to false"
        )


def _suffix_config(params: Parameters) -> SuffixConfig:
    """vLLM's suffix_decoding_* keys; an empty value keeps vLLM's default."""
    defaults = SuffixConfig()
    values = {
        "max_tree_depth": params.get_int("suffix_decoding_max_tree_depth", defaults.max_tree_depth),
        "max_cached_requests": params.get_int("suffix_decoding_max_cached_requests", defaults.max_cached_requests),
        "max_spec_factor": params.get_float("suffix_decoding_max_spec_factor", defaults.max_spec_factor),
        "min_token_prob": params.get_float("suffix_decoding_min_token_prob", defaults.min_token_prob),
    }
    try:
        return SuffixConfig(**values)
    except ValueError as err:
        raise ParameterError(f"draft_proposer: parameter {err}") from None


def _suffix_first_config(params: Parameters, method: str, suffix: SuffixConfig) -> SuffixFirstConfig | None:
    """``enable_suffix_decoding`` (Arctic Inference's key) beside a model method, with its two settings."""
    enabled = params.get_bool("enable_suffix_decoding", False)
    min_score = params.get_float("suffix_decoding_min_score", DEFAULT_MIN_SCORE)
    model_tokens = params.get_int("model_num_speculative_tokens", 0, minimum=0)
    if not enabled:
        return None  # its two settings, if given, are warned of (unread_settings)
    if method in MODEL_FREE_METHODS:
        raise ParameterError(f"draft_proposer: enable_suffix_decoding puts suffix decoding in front of a model "
                             f"(method draft_model, {' or '.join(HEAD_METHODS)}); method is {method!r}")  # fmt: skip
    try:
        return SuffixFirstConfig(suffix, min_score, model_tokens)
    except ValueError as err:
        raise ParameterError(f"draft_proposer: parameter {err}") from None


def _draft_max_model_len(params: Parameters, method: str) -> int | None:
    """draft_proposer's own ``max_model_len``, else target_verifier's in the same repository.

    A draft or head never holds more of a sequence than the target serves, and at a real
    model's ``max_position_embeddings`` (131072 for Llama 3) its cache and a head's feature
    buffer would take gigabytes the target's smaller window never uses. Model-free methods
    hold no cache and read none.
    """
    own = params.get_int("max_model_len", None, minimum=1)
    if own is not None or method in MODEL_FREE_METHODS or not params.repository_dir:
        return own
    from specdec_triton.repository_config import model_settings

    found = model_settings(params.repository_dir, "target_verifier")
    return None if found is None else found[0].get_int("max_model_len", None, minimum=1)


def _head_target(params: Parameters, method: str) -> str | None:
    """The checkpoint a head drafts for: draft_proposer's own ``target_model`` when set, else
    target_verifier's in the same repository (the checkpoint the server verifies with), so a
    repository names its target once. Methods without a head read none."""
    if method not in HEAD_METHODS:
        params.get_str("target_model", None)  # read, so that a value left from a head method is no unknown key
        return None
    own = params.get_path("target_model", None)
    if own is not None:
        return own
    from specdec_triton.repository_config import model_settings

    found = model_settings(params.repository_dir, "target_verifier") if params.repository_dir else None
    if found is None:  # read outside a repository: the default target_verifier itself would serve
        return params.get_path("target_model", DEFAULT_TARGET_MODEL)
    return TargetVerifierConfig.from_parameters(found[0]).target_model


@dataclass(frozen=True)
class TargetVerifierConfig:
    target_model: str  # checkpoint directory
    dtype: str
    max_model_len: int | None  # prompt + output tokens; None -> the model's max_position_embeddings
    engine: str
    max_num_seqs: int  # the orchestrator admits no more sequences than this at once
    cpu_compile: bool = False  # fast engine on CPU: the forward compiled by torch.compile (slower load, faster steps)
    sequence_idle_timeout_s: float = DEFAULT_SEQUENCE_IDLE_TIMEOUT_S  # 0: never reclaim

    @classmethod
    def from_parameters(cls, params: Parameters) -> TargetVerifierConfig:
        config = cls(
            target_model=params.get_path("target_model", DEFAULT_TARGET_MODEL),
            dtype=params.get_str("dtype", "auto", choices=DTYPE_CHOICES),
            max_model_len=params.get_int("max_model_len", None, minimum=1),
            engine=params.get_str("engine", "fast", choices=ENGINES),
            max_num_seqs=params.get_int("max_num_seqs", DEFAULT_MAX_NUM_SEQS, minimum=1),
            cpu_compile=params.get_bool("cpu_compile", False),
            sequence_idle_timeout_s=_idle_timeout(params),
        )
        _refuse_removed_placement(params, "target_verifier")
        params.check_all_read()
        return config


def _idle_timeout(params: Parameters) -> float:
    """0 (never reclaim) or at least three renewal intervals (specdec_triton.leases), so that a live request's
    sequence, renewed every RENEW_INTERVAL_S, is never taken between two renewals."""
    timeout = params.get_float("sequence_idle_timeout_s", DEFAULT_SEQUENCE_IDLE_TIMEOUT_S, minimum=0.0)
    if 0 < timeout < MIN_IDLE_TIMEOUT_S:
        raise params.invalid("sequence_idle_timeout_s", f"{timeout:g}", f"0 (never reclaim) or >= {MIN_IDLE_TIMEOUT_S:g} "
                             "(three renewals of live requests' sequences)")
    return timeout


@dataclass(frozen=True)
class RejectionSamplerConfig:
    method: str  # probabilistic (lossless), strict (lossless, no q), synthetic (benchmarking only)
    synthetic_acceptance_rate: float  # read by method synthetic only
    use_triton_kernel: bool  # the Triton kernel instead of the torch path; needs a GPU instance

    @classmethod
    def from_parameters(cls, params: Parameters) -> RejectionSamplerConfig:
        config = cls(
            method=params.get_str("rejection_sample_method", "probabilistic", choices=METHODS),
            synthetic_acceptance_rate=params.get_float("synthetic_acceptance_rate", 0.0, minimum=0.0, maximum=1.0),
            use_triton_kernel=params.get_bool("use_triton_kernel", False),
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
    on_stub_failure: str = "reload"  # a composing model's process died: reload it (else stop the server) | stop
    health_check_interval_s: float = 0.5  # how often the composing models' processes are checked
    max_request_seconds: float = 0.0  # a request still running after this long is cancelled; 0: no limit
    # the request parameter naming the client (a header the gateway sets and Triton forwards); None: not named
    client_id_parameter: str | None = None
    max_sequences_per_client: int = 0  # requests one client may have in flight; 0: no limit
    # how a step calls the models holding sequences: socket (specdec_triton.socket_calls, ~0.4 ms a call) | bls
    stage_calls: str = "socket"

    @classmethod
    def from_parameters(cls, params: Parameters) -> OrchestratorConfig:
        k = params.get_int("num_speculative_tokens", 4, minimum=0)
        table = params.get_str("num_speculative_tokens_per_batch_size", "")
        try:
            speculation = SpeculationLength(
                num_speculative_tokens=k,
                per_batch_size=parse_per_batch_size(table),
                disable_by_batch_size=params.get_int("speculative_disable_by_batch_size", 0, minimum=0),
                follows_acceptance=params.get_bool("speculation_follows_acceptance", True),
            )
        except ValueError as err:
            raise ParameterError(f"speculative_decoding: parameter 'num_speculative_tokens_per_batch_size' {err}") from None
        config = cls(
            num_speculative_tokens=k,
            default_max_tokens=params.get_int("default_max_tokens", 64, minimum=1),
            speculation=speculation,
            ignored_request_parameters=params.get_pattern("ignored_request_parameters"),
            on_stub_failure=params.get_str("on_stub_failure", "reload", choices=ON_STUB_FAILURE),
            health_check_interval_s=params.get_float("health_check_interval_s", 0.5, minimum=0.05, maximum=60.0),
            max_request_seconds=params.get_float("max_request_seconds", 0.0, minimum=0.0),
            client_id_parameter=params.get_str("client_id_parameter", None),
            max_sequences_per_client=params.get_int("max_sequences_per_client", 0, minimum=0),
            stage_calls=params.get_str("stage_calls", "socket", choices=STAGE_CALLS),
        )
        params.get_str(PARAMETER, "")  # vLLM's JSON: every model applied it to its own keys while loading
        params.check_all_read()
        return config
