#!/usr/bin/env python3
"""Write a random-weight Llama checkpoint of a real size, made locally (no downloads).

Benchmarks need models whose *cost* is realistic; their outputs do not matter
(pair them with ``rejection_sample_method: synthetic``). Every preset uses the
tokenizer of the shipped pair, so a random target and the shipped draft, or two
random checkpoints, share one vocabulary.

    python scripts/make_random_model.py --preset llama-125m --out models/random-125m
    python scripts/make_random_model.py --list
    python scripts/make_random_model.py --head eagle3 --target models/random-1b --out models/random-1b-eagle3

``--head eagle3|mlp_speculator`` writes a random draft head shaped for ``--target`` instead
(one decoder layer of the target's width for EAGLE-3, ``n_predict`` stages of its hidden
size for the MLP speculator), in the format ``draft_model`` loads: its cost per drafted
token is a trained head's, its proposals are noise.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = REPO_ROOT / "models" / "tiny-target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


# Shapes follow published Llama-family models of similar size (e.g. Llama-3.2-1B, Llama-3.1-8B).
PRESETS = {
    "llama-30m": Preset(512, 8, 8, 8, 1408),
    "llama-125m": Preset(768, 12, 12, 12, 3072),
    "llama-350m": Preset(1024, 24, 16, 16, 2816),
    "llama-1b": Preset(2048, 16, 32, 8, 8192),
    "llama-3b": Preset(3072, 28, 24, 8, 8192),
    "llama-8b": Preset(4096, 32, 32, 8, 14336),
}


def parameter_count(preset: Preset, vocab_size: int) -> int:
    head_dim = preset.hidden_size // preset.num_attention_heads
    attn = preset.hidden_size * head_dim * (2 * preset.num_attention_heads + 2 * preset.num_key_value_heads)
    mlp = 3 * preset.hidden_size * preset.intermediate_size
    per_layer = attn + mlp + 2 * preset.hidden_size
    return preset.num_hidden_layers * per_layer + 2 * vocab_size * preset.hidden_size + preset.hidden_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="dir with tokenizer.json")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="0: the tokenizer's; larger (e.g. 128256, Llama 3's) sizes the embedding and LM head of "
                             "a real model, whose extra ids the tokenizer never produces")  # fmt: skip
    parser.add_argument("--draft-vocab-size", type=int, default=32000,
                        help="--head eagle3: rows of its LM head (at most the target's vocabulary)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the random weights are drawn (the same seed draws other numbers on another device)")
    parser.add_argument("--list", action="store_true", help="print the presets and their sizes")
    parser.add_argument("--head", choices=("eagle3", "mlp_speculator"), help="write a draft head for --target")
    parser.add_argument("--target", type=Path, help="--head: the target checkpoint it drafts for")
    parser.add_argument("--n-predict", type=int, default=4, help="--head mlp_speculator: stages")
    parser.add_argument("--num-layers", type=int, default=1, help="--head eagle3: decoder layers")
    args = parser.parse_args()
    if args.head:
        if args.target is None or args.out is None:
            parser.error("--head needs --target and --out")
        write_random_head(args.head, args.target, args.out, getattr(torch, args.dtype), args.seed, args.n_predict,
                          args.draft_vocab_size, args.num_layers)  # fmt: skip
        return

    vocab_size = max(args.vocab_size, _vocab_size(args.tokenizer))
    if args.list:
        for name, preset in PRESETS.items():
            print(f"{name:12s} {parameter_count(preset, vocab_size) / 1e6:8.0f} M params  {asdict(preset)}")
        return
    if args.preset is None or args.out is None:
        parser.error("--preset and --out are required (or --list)")

    preset = PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    eos_id = _eos_id(args.tokenizer)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=args.max_model_len,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype=args.dtype,
        **asdict(preset),
    )
    print(f"[make_random_model] {args.preset}: {parameter_count(preset, vocab_size) / 1e6:.0f} M params, "
          f"{args.dtype} -> {args.out}", flush=True)
    started = time.time()
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise directly in the target dtype: an 8B model fits in memory
    try:
        with torch.device(args.init_device):  # a GPU draws a billion random weights in seconds, a CPU in a minute
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size="2GB")
    GenerationConfig(do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, args.out / name)
    print(f"[make_random_model] wrote {args.out} in {time.time() - started:.1f} s", flush=True)


def write_random_head(method: str, target: Path, out: Path, dtype: torch.dtype, seed: int, n_predict: int,
                      draft_vocab_size: int, num_layers: int = 1) -> None:  # fmt: skip
    sys.path.insert(0, str(REPO_ROOT))
    from specdec.fast.checkpoint import read_config

    arch = read_config(target)
    torch.manual_seed(seed)
    if method == "eagle3":
        from specdec.heads.eagle3 import Eagle3Head, eagle3_config_for
        from specdec.heads.formats import save_eagle3

        config = eagle3_config_for(arch, min(draft_vocab_size, arch.vocab_size), num_layers=num_layers)
        head = Eagle3Head(config).to(dtype)
        save_eagle3(head, out, verifier=str(target))
    else:
        from specdec.heads.mlp_speculator import MLPSpeculator, save_mlp_speculator

        config = dict(n_predict=n_predict, emb_dim=arch.hidden_size, inner_dim=arch.hidden_size,
                      vocab_size=arch.vocab_size, tie_weights=False, scale_input=True)  # fmt: skip
        save_mlp_speculator(MLPSpeculator(config).to(dtype), out)
    print(f"[make_random_model] wrote a random {method} head for {target} to {out}", flush=True)


def _tokenizer_json(tokenizer_dir: Path) -> Path:
    path = tokenizer_dir / "tokenizer.json"
    if not path.exists():
        sys.exit(f"--tokenizer {tokenizer_dir}: no tokenizer.json there (train the shipped pair first: "
                 f"python scripts/train_tiny_models.py)")
    return path


def _vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_tokenizer_json(tokenizer_dir))).get_vocab_size(with_added_tokens=True)


def _eos_id(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id


if __name__ == "__main__":
    main()
