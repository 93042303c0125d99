"""Benchmark prompts: slices of held-out Python standard-library files.

The shipped pair is trained on the standard library with files whose
``crc32(relative path) % 20 == 0`` held out (``scripts/train_tiny_models.py``);
prompts come from those files only, so acceptance is measured on text the draft
and target never trained on. Prompts are whole lines, cut once they reach about
``prompt_tokens`` tokens, so they end where a code-completion request would.
"""
from __future__ import annotations

import random
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_MODULUS = 20  # one file in 20 is held out (same split as the training script)


@dataclass(frozen=True)
class Prompt:
    source: str  # relative path of the file the slice comes from, and its first line
    text: str
    token_ids: list[int]


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_MODULUS == 0


def held_out_texts(root: Path | None = None) -> dict[str, str]:
    """``{relative path: text}`` of the held-out ``.py`` files under ``root`` (default: the stdlib)."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    texts = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel or not is_held_out(rel):
            continue
        texts[rel] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def select_prompts(
    texts: dict[str, str],
    encode: Callable[[str], list[int]],
    num_prompts: int,
    prompt_tokens: int,
    seed: int = 0,
) -> list[Prompt]:
    """``num_prompts`` slices of whole lines, each of at least ``prompt_tokens`` tokens.

    Files are visited in a seeded order, one slice per file per pass, starting at a
    seeded line that is not blank; files too short for a slice are skipped. Raises
    ValueError when the texts cannot supply ``num_prompts`` slices.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    rng = random.Random(seed)
    names = sorted(texts)
    rng.shuffle(names)
    prompts: list[Prompt] = []
    for _ in range(num_prompts):  # passes; each yields one slice per usable file
        found = False
        for name in names:
            prompt = _slice(name, texts[name], encode, prompt_tokens, rng)
            if prompt is None:
                continue
            found = True
            prompts.append(prompt)
            if len(prompts) == num_prompts:
                return prompts
        if not found:
            break
    raise ValueError(
        f"only {len(prompts)} of {num_prompts} prompts of {prompt_tokens} tokens could be cut from {len(texts)} files"
    )


def _slice(
    name: str, text: str, encode: Callable[[str], list[int]], prompt_tokens: int, rng: random.Random
) -> Prompt | None:
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip()]
    if not starts:
        return None
    start = rng.choice(starts)
    for end in range(start + 1, len(lines) + 1):
        piece = "".join(lines[start:end])
        ids = encode(piece)
        if len(ids) >= prompt_tokens:
            return Prompt(source=f"{name}:{start + 1}", text=piece, token_ids=list(ids))
    return None
