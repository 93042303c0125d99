"""Every served model's ``config.pbtxt`` parameters, each declared once: name, kind, default, allowed values, meaning.

``specdec_triton.configs`` reads each parameter through its declaration (``Reader``), so a
default or a bound lives here and nowhere else, and ``scripts/parameter_tables.py`` writes the
tables of ``docs/configuration.md`` from the same declarations (a unit test fails when the page
drifts). Rules that tie two keys together (``prompt_lookup_min <= prompt_lookup_max``, a head's
target) stay with the config that applies them; ``allowed`` then says them in words.

A meaning is one line of markdown for that table: links are relative to ``docs/``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from specdec.compile_locks import DEFAULT_LOCK_TIMEOUT_S
from specdec.cached_lm import DTYPE_CHOICES, ENGINES
from specdec.methods import METHODS as DRAFT_METHODS
from specdec.proposers.suffix import SuffixConfig
from specdec.rejection_sampler import METHODS
from specdec.suffix_first import DEFAULT_MIN_SCORE
from specdec_triton.leases import MIN_IDLE_TIMEOUT_S, RENEW_INTERVAL_S
from specdec_triton.recovery import ON_STUB_FAILURE

if TYPE_CHECKING:
    from specdec_triton.plumbing import Parameters

KINDS = ("str", "int", "float", "bool", "path", "pattern")  # how a string value is read (plumbing.Parameters)
DEFAULT_TARGET_MODEL = "${SPECDEC_MODELS_DIR}/tiny-target"  # scripts/serve.sh sets it to <checkout>/models
DEFAULT_DRAFT_MODEL = "${SPECDEC_MODELS_DIR}/tiny-draft"
STAGE_CALLS = ("socket", "bls")  # speculative_decoding's stage_calls


@dataclass(frozen=True)
class Parameter:
    name: str  # the config.pbtxt key
    kind: str  # one of KINDS
    default: Any  # the value when the key is absent or empty; None: unset, and `unset` says what that means
    meaning: str
    choices: tuple[str, ...] | None = None  # kind str: the values allowed
    minimum: float | None = None  # kinds int and float: inclusive bounds, checked at read
    maximum: float | None = None
    allowed: str | None = None  # a rule checked elsewhere (by the config, or across keys), in words
    unset: str | None = None  # what a None default means, in words

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"parameter {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    def read(self, params: Parameters) -> Any:
        """The value ``params`` holds for this key (the default when absent or empty), checked as declared."""
        if self.kind == "str":
            return params.get_str(self.name, self.default, choices=self.choices)
        if self.kind == "int":
            return params.get_int(self.name, self.default, minimum=self.minimum, maximum=self.maximum)
        if self.kind == "float":
            return params.get_float(self.name, self.default, minimum=self.minimum, maximum=self.maximum)
        if self.kind == "bool":
            return params.get_bool(self.name, self.default)
        if self.kind == "path":
            return params.get_path(self.name, self.default)
        return params.get_pattern(self.name)


class Reader:
    """One model's parameters, read by name through their declarations: ``read("max_num_seqs")``.

    A name the model does not declare is a KeyError, so a key is never read with a default of its own.
    """

    def __init__(self, model: str, params: Parameters):
        self.declared = {p.name: p for p in MODELS[model]}
        self.params = params

    def __call__(self, name: str) -> Any:
        return self.declared[name].read(self.params)

    def values(self, *names: str) -> dict[str, Any]:
        """``{name: value}``: the keyword arguments of a config whose fields are named as its keys."""
        return {name: self(name) for name in names}

    def text(self, name: str) -> str | None:
        """The value as written (None when empty), unchecked: a path another setting leaves unresolved."""
        key = self.declared[name].name  # declared, or a KeyError
        return self.params.get_str(key, None)


def default(model: str, name: str) -> Any:
    """The declared default of ``model``'s ``name``: what a config dataclass field defaults to."""
    return next(p.default for p in MODELS[model] if p.name == name)


# --- shared by draft_proposer and target_verifier --------------------------------------------------

_DTYPE = Parameter("dtype", "str", "auto", "`auto`: float32 on CPU, bfloat16 on GPU", choices=DTYPE_CHOICES)
_ENGINE = Parameter(
    "engine", "str", "fast",
    "`fast`: Llama, Mistral, Qwen2, Qwen3; every sequence of a dynamic batch in one forward over a static "
    "slot KV cache, CUDA graphs on GPU ([engine](engine.md)); `hf`: any `AutoModelForCausalLM`, one sequence "
    "at a time", choices=ENGINES)  # fmt: skip
_MAX_NUM_SEQS = Parameter(
    "max_num_seqs", "int", 8,
    "sequences held at once (the `fast` engine's KV-cache slots); the orchestrator runs at most the smaller "
    "of the two models'", minimum=1)  # fmt: skip
_CPU_COMPILE = Parameter(
    "cpu_compile", "bool", False,
    "on CPU, the `fast` engine's forward compiled by `torch.compile` at load (needs `g++`): 1.35-1.5x the "
    "served tokens/s on the 2-core CPU, 15 s (cache warm) to 75 s (cold) more per load "
    "([engine](engine.md#compiled-forward-on-cpu-fastcpu_compilepy)); ignored on GPU, which captures CUDA "
    "graphs; refused with `engine: hf`")  # fmt: skip
_COMPILE_LOCK_TIMEOUT_S = Parameter(
    "compile_lock_timeout_s", "float", DEFAULT_LOCK_TIMEOUT_S,
    "with `cpu_compile`: the longest a compile waits for one of torch inductor's lock files (another process "
    "builds the same kernel, or is stuck holding it); then the load fails, naming the lock and the process that "
    "holds it ([reliability](reliability.md#a-compile-that-waits-on-a-lock))", minimum=1.0)  # fmt: skip
SEQUENCE_IDLE_TIMEOUT_S = Parameter(
    "sequence_idle_timeout_s", "float", 120.0,
    f"a sequence untouched this long lost its caller (a failed release): its slot is reclaimed, logged and "
    f"counted; the orchestrator renews the sequences of live requests every {RENEW_INTERVAL_S:g} s, so a live "
    f"one is never taken ([reliability](reliability.md#slots-nobody-releases))",
    minimum=0.0,
    allowed=f"0 (never reclaim) or >= {MIN_IDLE_TIMEOUT_S:g} (three renewals of live requests' sequences)")  # fmt: skip

# --- the models ---------------------------------------------------------------------------------------

TOKENIZER = (
    Parameter("tokenizer_dir", "path", DEFAULT_TARGET_MODEL,
              "a directory with `tokenizer.json`: the target's, whose ids index its vocabulary; the "
              "orchestrator decodes with the tokenizer model's"),  # fmt: skip
)

_SUFFIX = SuffixConfig()  # vLLM's defaults
DRAFT_PROPOSER = (
    Parameter(
        "method", "str", "draft_model",
        "`draft_model`: a small LM; `ngram`: prompt lookup; `suffix`: suffix decoding over the request's text "
        "and past responses ([speculative_config.md](speculative_config.md)); `eagle3`, `mlp_speculator`, `medusa`, "
        "`dflash`: a head over the target's hidden states ([drafters](drafters.md#draft-heads-eagle-3-and-the-mlp-speculator), "
        "[DFlash](drafters.md#dflash-a-block-of-drafts-in-one-pass)); "
        "`mtp`: the target's own MTP layer, read from its checkpoint ([drafters](drafters.md#the-targets-own-mtp-layer)); "
        "`ngram` and `suffix` run in speculative_decoding's process", choices=tuple(DRAFT_METHODS)),  # fmt: skip
    Parameter("draft_model", "path", DEFAULT_DRAFT_MODEL,
              "a Hugging Face checkpoint sharing the target's vocabulary, or a head's directory; not read under `mtp`, "
              "nor resolved under `ngram` and `suffix`"),  # fmt: skip
    Parameter("target_model", "path", None,
              "heads only: the target checkpoint the head drafts for, checked against it (a head without "
              "`embed_tokens` shares its embedding)", unset="target_verifier's `target_model`"),  # fmt: skip
    Parameter("prompt_lookup_min", "int", None, "`ngram` only: the shortest n-gram matched", minimum=1,
              allowed="<= `prompt_lookup_max`", unset="vLLM's rule: 5, or `prompt_lookup_max` when only it is given"),
    Parameter("prompt_lookup_max", "int", None, "`ngram` only: the longest n-gram matched", minimum=1,
              unset="vLLM's rule: 5, or `prompt_lookup_min` when only it is given"),  # fmt: skip
    Parameter("suffix_decoding_max_tree_depth", "int", _SUFFIX.max_tree_depth,
              "`suffix` (or `enable_suffix_decoding`): the longest match, and every tree's depth", allowed=">= 1"),
    Parameter("suffix_decoding_max_cached_requests", "int", _SUFFIX.max_cached_requests,
              "`suffix` (or `enable_suffix_decoding`): completed responses the global tree keeps, oldest evicted "
              "first; 0: no global tree", allowed=">= 0"),  # fmt: skip
    Parameter("suffix_decoding_max_spec_factor", "float", _SUFFIX.max_spec_factor,
              "`suffix` (or `enable_suffix_decoding`): a match of m tokens drafts at most m * factor",
              allowed="> 0"),  # fmt: skip
    Parameter("suffix_decoding_min_token_prob", "float", _SUFFIX.min_token_prob,
              "`suffix` (or `enable_suffix_decoding`): drafting stops where the continuation's estimated "
              "probability falls below this", allowed="in [0, 1]"),  # fmt: skip
    Parameter("suffix_decoding_use_tree_spec", "bool", _SUFFIX.use_tree_spec,
              "`suffix` (or `enable_suffix_decoding`): draft the speculation tree (the most probable "
              "continuations, branches included; Arctic Inference's `use_tree_spec`), verified as a tree "
              "([trees](drafters.md#draft-trees)); false: the most frequent path alone"),  # fmt: skip
    Parameter("speculative_token_tree", "str", "",
              "`eagle3`, `medusa`, `mlp_speculator`, `draft_model` (engine `fast`): vLLM's static tree, the path of child ranks of each node, e.g. "
              "`[(0,), (1,), (0, 0)]` ([trees](drafters.md#draft-trees)); as in vLLM its node count must equal "
              "`num_speculative_tokens`", unset="a chain"),  # fmt: skip
    Parameter("speculative_eagle_topk", "int", 0,
              "`eagle3`: with `speculative_num_steps`, EAGLE-2's dynamic tree: each level expands this many of the "
              "likeliest nodes, this many children each; the `num_speculative_tokens` likeliest nodes are verified "
              "([trees](drafters.md#draft-trees)); 0: no dynamic tree", minimum=0),  # fmt: skip
    Parameter("speculative_num_steps", "int", 0,
              "`eagle3` with `speculative_eagle_topk`: the dynamic tree's depth (head passes + 1)", minimum=0),
    Parameter("enable_suffix_decoding", "bool", False,
              "with `draft_model` or a head (`eagle3`, `mlp_speculator`, `medusa`, `dflash`): suffix decoding first, the model only for a "
              "sequence whose suffix draft scores under `suffix_decoding_min_score` "
              "([drafters](drafters.md#suffix-decoding-in-front-of-a-model)); refused with `ngram` and `suffix`"),
    Parameter("suffix_decoding_min_score", "float", DEFAULT_MIN_SCORE,
              "with `enable_suffix_decoding`: the expected matching tokens at which suffix decoding's draft is "
              "taken", allowed="> 0"),  # fmt: skip
    Parameter("model_num_speculative_tokens", "int", 0,
              "with `enable_suffix_decoding`: the most tokens the model drafts where suffix decoding's draft is "
              "not taken; 0: the step's k", minimum=0),  # fmt: skip
    _DTYPE,
    _ENGINE,
    _MAX_NUM_SEQS,
    replace(_CPU_COMPILE, meaning="`draft_model` and `eagle3` (the MLP speculator, Medusa and DFlash run eagerly): "
                                  + _CPU_COMPILE.meaning),  # fmt: skip
    _COMPILE_LOCK_TIMEOUT_S,
    SEQUENCE_IDLE_TIMEOUT_S,
    Parameter("max_model_len", "int", None,
              "`draft_model` and heads: tokens of a sequence the draft's cache (a head's cache and feature "
              "buffer) holds; below the target's is refused when the orchestrator first describes the models",
              minimum=1, unset="target_verifier's (empty there too: the checkpoint's "
              "`max_position_embeddings`, a head's target's)"),  # fmt: skip
    Parameter("parallel_drafting", "bool", False,
              "`draft_model` and `eagle3`: every draft of a step from one forward over the sequence and k - 1 mask "
              "tokens; `draft_model`: a PARD draft naming its mask token (`pard_token` in config.json); `eagle3`: a "
              "P-EAGLE head (`mask_hidden` in its weights, `mask_token_id` or `ptd_token_id` in config.json) "
              "([speculative_config.md](speculative_config.md#parallel-drafting-pard-and-p-eagle)); a checkpoint "
              "without them and every other method are refused, and a tree with it"),  # fmt: skip
    Parameter("run_with_target", "bool", False,
              "`draft_model` and heads: target_verifier loads the draft beside the target, and "
              "a step is one call there that proposes and verifies "
              "([drafters](drafters.md#where-a-drafter-runs)); needs `stage_calls: socket`"),  # fmt: skip
)

TARGET_VERIFIER = (
    Parameter("target_model", "path", DEFAULT_TARGET_MODEL, "a Hugging Face checkpoint: the model served"),
    _DTYPE,
    Parameter("max_model_len", "int", None,
              "prompt + output tokens a sequence may hold; more than the checkpoint's `max_position_embeddings` "
              "fails the load", minimum=1, unset="the checkpoint's `max_position_embeddings`"),  # fmt: skip
    _ENGINE,
    _MAX_NUM_SEQS,
    _CPU_COMPILE,
    _COMPILE_LOCK_TIMEOUT_S,
    SEQUENCE_IDLE_TIMEOUT_S,
)

REJECTION_SAMPLER = (
    Parameter("rejection_sample_method", "str", "probabilistic",
              "`probabilistic` (Leviathan et al. 2023) and `strict` are lossless; `synthetic` accepts drafts at "
              "random, for benchmarking only", choices=METHODS),  # fmt: skip
    Parameter("synthetic_acceptance_rate", "float", 0.0, "`synthetic` only: each draft's chance to be accepted",
              minimum=0.0, maximum=1.0),  # fmt: skip
    Parameter("use_triton_kernel", "bool", False,
              "the Triton rejection kernel instead of the torch path; needs a `KIND_GPU` instance"),
)

SPECULATIVE_DECODING = (
    Parameter("speculative_config", "str", "",
              "vLLM's JSON, applied by every model over its own keys while loading (also `scripts/serve.sh "
              "--speculative-config`; [speculative_config.md](speculative_config.md#speculative_config))"),
    Parameter("num_speculative_tokens", "int", 4,
              "k: the most drafts a step allows a sequence, and the most a request may ask for", minimum=0),
    Parameter("num_speculative_tokens_per_batch_size", "str", "",
              "`size:k,...`: the most drafts a step of that many sequences allows, each entry up to the next, the "
              "first for size 1; empty: always k ([scheduling](scheduling.md#how-many-tokens-a-step-drafts))",
              allowed="each k <= `num_speculative_tokens`"),  # fmt: skip
    Parameter("speculative_disable_by_batch_size", "int", 0,
              "steps draft nothing while more sequences than this run; 0: never", minimum=0),
    Parameter("speculation_follows_acceptance", "bool", True,
              "under the table's cap, each sequence drafts what its own acceptance and the measured step costs "
              "earn (SmartSpec's goodput rule): drafts that keep failing, fewer, down to a probe now and then; "
              "false: every sequence drafts the cap, exactly as the table says "
              "([scheduling.md](scheduling.md#speculation-that-follows-acceptance))"),
    Parameter("default_max_tokens", "int", 64, "`max_tokens` of a request that sends none", minimum=1),
    Parameter("ignored_request_parameters", "pattern", None,
              "request parameters whose whole name it matches (headers Triton forwards, e.g. with "
              "`--grpc-header-forward-pattern`) are accepted and left unread; any other is refused",
              unset="none"),  # fmt: skip
    Parameter("on_stub_failure", "str", "reload",
              "a composing model's process died: `reload` it (the server stops when it cannot), or `stop` the "
              "server ([reliability](reliability.md#health-and-recovery))", choices=ON_STUB_FAILURE),  # fmt: skip
    Parameter("health_check_interval_s", "float", 0.5, "how often the composing models' processes are checked",
              minimum=0.05, maximum=60.0),  # fmt: skip
    Parameter("max_request_seconds", "float", 0.0,
              "a request running longer is cancelled (bounds an HTTP `/generate` whose client left, which Triton "
              "2.51 cannot tell); 0: no limit", minimum=0.0),  # fmt: skip
    Parameter("client_id_parameter", "str", None,
              "the request parameter naming the client (a header Triton forwards) "
              "([reliability](reliability.md#the-per-boot-secret))", unset="clients not told apart"),  # fmt: skip
    Parameter("max_sequences_per_client", "int", 0,
              "requests one client (`client_id_parameter`) may have in flight; 0: no limit", minimum=0),
    Parameter("stage_calls", "str", "socket",
              "how a step calls draft_proposer and target_verifier: `socket`, on the Unix socket each describes "
              "(~0.4 ms a call beyond the model's own time), or `bls`, a BLS request each (~1 ms) "
              "([scheduling](scheduling.md#step-calls-on-a-socket))", choices=STAGE_CALLS),  # fmt: skip
)

# by model name; the tokenizer and the detokenizer read the same one
MODELS: Mapping[str, tuple[Parameter, ...]] = {
    "tokenizer": TOKENIZER,
    "detokenizer": TOKENIZER,
    "draft_proposer": DRAFT_PROPOSER,
    "target_verifier": TARGET_VERIFIER,
    "rejection_sampler": REJECTION_SAMPLER,
    "speculative_decoding": SPECULATIVE_DECODING,
}
