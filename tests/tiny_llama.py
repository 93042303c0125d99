"""Random tiny Llama models and Hugging Face's own greedy decoding: the references the tests compare against.

A module of its own (not conftest) so test files import it by name: with the e2e
directory's conftest also on the path, ``from conftest import`` is ambiguous.
"""
from __future__ import annotations

import weakref

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel


def build_tiny_llama(
    seed: int,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    initializer_range: float = 0.1,
    max_position_embeddings: int = 1024,
) -> PreTrainedModel:
    """A random Llama; a larger ``initializer_range`` than HF's 0.02 keeps logits from being near-uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


# each model's references decoded so far, keyed weakly by the model object itself: a model
# built for one test and freed never lends its references to one that gets its address
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_generate_greedy(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    min_new_tokens: int = 0,
) -> list[int]:
    """The reference: Hugging Face's own greedy decoding, from a fresh generation config.

    Remembered per model and arguments, so a test that checks several k or methods
    against the same prompts decodes each reference once a session. A test must not
    change a model's weights after asking for its references.
    """
    key = (tuple(prompt_ids), max_new_tokens, eos_token_id, min_new_tokens)
    known = _REFERENCES.setdefault(model, {})
    if key not in known:
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
        known[key] = out[0, len(prompt_ids) :].tolist()
    return list(known[key])
