#!/usr/bin/env python3
"""Fill torch inductor's compile cache for a model repository, so that the server's first start is quick.

    python scripts/warm_cache.py [--repository DIR] [--force]

On CPU, with ``cpu_compile``, target_verifier and a draft_proposer that runs a model compile
their forward at load (``specdec.fast.cpu_compile``): on a 2-core machine a minute or more from
an empty cache, a fraction of that from a warm one. This builds those models as their
``model.py`` does, from the repository's own ``config.pbtxt``, in the server's environment
(``scripts/serve.sh``'s ``OMP_NUM_THREADS`` and ``TORCHINDUCTOR_CACHE_DIR``), so the graphs and
kernels it compiles are the ones the server then finds in the cache. ``scripts/setup.sh`` runs it.

Idempotent: a stamp in the cache directory records a fingerprint of what shapes the compiled
code (torch's version, the engine's sources, the repository's two configs, the checkpoints'
``config.json``, the thread count); while it matches, a run prints one line and exits without
importing torch. A change the fingerprint misses costs only time: the server compiles what the
cache lacks, as it would without this.

Environment: ``SPECDEC_WARM_CACHE=0`` skips it; ``TORCHINDUCTOR_CACHE_DIR`` (default
``<checkout>/.cache/torchinductor``, as serve.sh); ``SPECDEC_MODELS_DIR`` (default
``<checkout>/models``); ``OMP_NUM_THREADS`` (default 1, as serve.sh).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, whichever checkout the venv installed
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "torchinductor"  # scripts/serve.sh's default too
STAMP = "specdec-warm.json"
# sources whose change changes the compiled graphs: the fast engine, the heads and their proposers
SOURCES = ("specdec/fast/*.py", "specdec/heads/*.py", "specdec/proposers/eagle3*.py", "specdec/proposers/mtp.py")
MODELS = ("target_verifier", "draft_proposer")


def say(text: str) -> None:
    print(f"[warm-cache] {text}", flush=True)


def fingerprint(repository: Path, models_dir: Path) -> str:
    """What the cached code depends on, hashed; read without importing torch."""
    digest = hashlib.sha256()
    digest.update(f"torch {importlib.metadata.version('torch')} threads {os.environ['OMP_NUM_THREADS']}".encode())
    files = [p for pattern in SOURCES for p in sorted(REPO_ROOT.glob(pattern))]
    files += [repository / model / "config.pbtxt" for model in MODELS]
    files += sorted(models_dir.glob("*/config.json"))
    for path in files:
        digest.update(str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path).encode())
        digest.update(path.read_bytes() if path.is_file() else b"absent")
    return digest.hexdigest()


def warm(repository: Path) -> list[str]:
    """Build each model of ``repository`` that compiles, as its model.py does; the models warmed."""
    import torch

    from specdec.build import build_lm
    from specdec.compile_locks import set_lock_timeout
    from specdec.proposers.model_free import MODEL_FREE_METHODS
    from specdec_triton.configs import DraftProposerConfig, TargetVerifierConfig
    from specdec_triton.drafters import build_proposer, drafts_trees
    from specdec_triton.repository_config import model_settings

    if torch.cuda.is_available():
        say("a GPU answers: the models load there and capture CUDA graphs, which are not cached on disk")
        return []
    warmed = []
    found = model_settings(repository, "target_verifier")
    if found is not None:
        config = TargetVerifierConfig.from_parameters(found[0])
        if config.cpu_compile and config.engine == "fast":
            set_lock_timeout(config.compile_lock_timeout_s)
            say(f"target_verifier: {config.target_model} ({config.max_num_seqs} sequences)")
            build_lm(config.target_model, config.engine, config.dtype, "cpu", config.max_num_seqs, config.max_model_len,
                     log=lambda line: say(f"target_verifier: {line}"), cpu_compile=True,
                     warm_trees=drafts_trees(repository))  # fmt: skip
            warmed.append("target_verifier")
    found = model_settings(repository, "draft_proposer")
    if found is not None:
        config = DraftProposerConfig.from_parameters(found[0])
        if config.cpu_compile and config.method not in MODEL_FREE_METHODS:
            set_lock_timeout(config.compile_lock_timeout_s)
            say(f"draft_proposer: {config.method} {config.draft_model} ({config.max_num_seqs} sequences)")
            build_proposer(config, "cpu", log=lambda line: say(f"draft_proposer: {line}"))
            warmed.append("draft_proposer")
        else:
            say(f"draft_proposer: method {config.method!r} compiles nothing at load")
    return warmed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--force", action="store_true", help="warm even where the stamp says the cache is warm")
    args = parser.parse_args()
    if os.environ.get("SPECDEC_WARM_CACHE", "1") == "0":
        say("skipped (SPECDEC_WARM_CACHE=0)")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; serve.sh's default
    os.environ.setdefault("SPECDEC_MODELS_DIR", str(REPO_ROOT / "models"))
    cache_dir = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DEFAULT_CACHE_DIR)))
    repository = args.repository.resolve()
    stamp = cache_dir / STAMP
    want = fingerprint(repository, Path(os.environ["SPECDEC_MODELS_DIR"]))
    try:
        if not args.force and json.loads(stamp.read_text())["fingerprint"] == want:
            say(f"{cache_dir} is warm for {repository}")
            return 0
    except (OSError, ValueError, KeyError):
        pass
    say(f"compiling {repository}'s models into {cache_dir} (the server's first start then finds them there)")
    start = time.monotonic()
    warmed = warm(repository)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"fingerprint": want, "repository": str(repository), "models": warmed}) + "\n")
    say(f"done in {time.monotonic() - start:.0f} s: {', '.join(warmed) or 'nothing to compile'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
