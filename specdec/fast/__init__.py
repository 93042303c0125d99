"""The fast engine: Llama-family models loaded from safetensors, a static slot KV cache,
ragged batched forwards and CUDA graphs, behind the ``CachedLM`` contract."""
from specdec.cached_lm import ForwardCall
from specdec.fast.kv_cache import StaticKVCache
from specdec.fast.llama import FastLlama, load_fast_llama
from specdec.fast.runner import FastCausalLM

__all__ = ["FastCausalLM", "FastLlama", "ForwardCall", "StaticKVCache", "load_fast_llama"]
