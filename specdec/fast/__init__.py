"""The fast engine: Llama-family models loaded from safetensors, a static slot KV cache,
ragged batched forwards and CUDA graphs, behind the verifier and proposer contracts."""
from specdec.fast.draft import FastDraftProposer
from specdec.fast.kv_cache import StaticKVCache
from specdec.fast.llama import FastLlama, load_fast_llama
from specdec.fast.runner import FastCausalLM, ForwardCall
from specdec.fast.verifier import FastTargetVerifier

__all__ = [
    "FastCausalLM",
    "FastDraftProposer",
    "FastLlama",
    "FastTargetVerifier",
    "ForwardCall",
    "StaticKVCache",
    "load_fast_llama",
]
