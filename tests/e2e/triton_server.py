"""What the end-to-end tests add to ``bench.server``: repository copies, and the target as a reference.

Starting ``scripts/serve.sh`` on free ports, readiness and stopping are ``bench.server``'s;
here a failure to start fails the test with the server's log.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from bench.repository import get_parameters
from bench.server import REPO_ROOT, SERVE_SCRIPT, TritonServer
from bench.stats import Samples, parse_prometheus
from specdec.detokenize import stable_text
from specdec_triton.text import TextCodec

READY_TIMEOUT_S = 300  # six Python stubs importing torch on a busy 2-core machine take a while
MODEL_PATH_KEYS = ("target_model", "draft_model", "tokenizer_dir")
TIE_TOLERANCE = 1e-4  # top-2 logit gap below which either token is a correct greedy choice


def models_dir() -> Path:
    return Path(os.environ.get("SPECDEC_E2E_MODELS", REPO_ROOT / "models"))


class Server(TritonServer):
    """``bench.server.TritonServer`` with failures reported as test failures, the server's log attached."""

    def __init__(self, repository: Path, log_path: Path, openai: bool = False, serve_args: tuple[str, ...] = ()):
        super().__init__(SERVE_SCRIPT, repository, log_path, startup_timeout_s=READY_TIMEOUT_S, openai=openai,
                         serve_args=serve_args)  # fmt: skip

    def start(self) -> Server:
        """Start the server and wait until it is ready; fails the test with the log if it is not."""
        try:
            return super().start()
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(str(err))

    def run_until_exit(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Start the server and wait for it to exit by itself (a repository that must fail to load)."""
        try:
            return self.wait_exit(timeout_s)
        except TimeoutError as err:
            pytest.fail(f"{err}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the server; a stub that crashed, on its way out or before, fails the test (each model drops
        its metric families in ``finalize``, which python_backend#429 otherwise crashes on at exit)."""
        running = self.process is not None
        super().stop(timeout_s)
        if running and self.log_path.exists():
            assert "Segfault encountered" not in self.log_path.read_text(errors="replace"), \
                f"a model's stub crashed; the server's log: {self.log_path}"

    def metrics(self) -> Samples:
        """Prometheus samples as {(name, sorted label pairs): value}."""
        return parse_prometheus(self.metrics_text())


def _set_parameter(text: str, key: str, value: Callable[[str], str]) -> str:
    """``config.pbtxt`` text with parameter ``key``'s value replaced by ``value(old value)``."""
    pattern = rf'(key: "{key}" value: {{ string_value: ")([^"]*)"'
    return re.sub(pattern, lambda match: f'{match.group(1)}{value(match.group(2))}"', text)


def configured_parameter(model_dir: Path, key: str) -> str:
    """The string value of parameter ``key`` in ``model_dir/config.pbtxt``."""
    parameters = get_parameters((model_dir / "config.pbtxt").read_text())
    if key not in parameters:
        raise KeyError(f"{model_dir / 'config.pbtxt'} sets no parameter {key!r}")
    return parameters[key]


def repository_copy(
    destination: Path, models: Path, method: str, only: tuple[str, ...] = (), parameters: dict[str, str] | None = None
) -> Path:
    """The committed repository (or just the models in ``only``) with model paths pointing into
    ``models``, the proposer method set, and any other ``parameters`` (key -> value) replaced.

    A copy runs its models eagerly (``cpu_compile`` false) unless ``parameters`` say otherwise:
    copies test other features, each compile costs a server start tens of seconds on the
    CI machine, and the committed repository (the ``server`` fixture) serves compiled.
    """
    repository = destination / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository)
    for model in repository.iterdir():
        if only and model.name not in only:
            shutil.rmtree(model)
    for config in repository.glob("*/config.pbtxt"):
        text = config.read_text()
        for key in MODEL_PATH_KEYS:  # an empty one stays empty: it means another model's (a head's target)
            text = _set_parameter(text, key, lambda old: str(models / Path(old).name) if old else old)
        for key, value in {"method": method, "cpu_compile": "false", **(parameters or {})}.items():
            text = _set_parameter(text, key, lambda old, value=value: value)
        config.write_text(text)
    return repository


def server_on_free_ports(workdir: Path, repository: Path, openai: bool = False,
                         serve_args: tuple[str, ...] = ()) -> Server:  # fmt: skip
    """A server on free ports, not started; ``openai``: with the OpenAI API on one more."""
    return Server(repository, workdir / "tritonserver.log", openai, serve_args)


@dataclass
class Reference:
    """The target run in-process by Hugging Face ``generate``: what greedy serving must reproduce."""

    model: torch.nn.Module
    codec: TextCodec
    max_model_len: int

    def greedy_ids(
        self, prompt: str, max_tokens: int, eos_token_ids: list[int] | None = None, min_new_tokens: int = 0
    ) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids); EOS defaults to the server's: the tokenizer's and generation config's."""
        prompt_ids = self.codec.encode_prompt(prompt)
        eos = self.codec.eos_token_ids if eos_token_ids is None else eos_token_ids
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=min_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt_ids]), generation_config=config)
        return prompt_ids, out[0, len(prompt_ids) :].tolist()

    def top2_gap(self, token_ids: list[int]) -> float:
        """Logit gap between the target's two best next tokens after ``token_ids``."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([token_ids])).logits[0, -1].float()  # [vocab]
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    def drafts_of_greedy_outputs(self, results: list[tuple[str, object]], max_tokens: int) -> tuple[int, int]:
        """(drafted, accepted) over ``(prompt, result)`` pairs, failing on each text that is not the target's own."""
        failures = [f for prompt, r in results if (f := self.greedy_mismatch(prompt, r.text, max_tokens))]
        assert not failures, "\n".join(failures)
        return (sum(r.total_draft_tokens for _, r in results),
                sum(r.total_accepted_draft_tokens for _, r in results))  # fmt: skip

    def greedy_mismatch(self, prompt: str, text: str, max_tokens: int) -> str | None:
        """None when ``text`` is the target's greedy output up to a near-tie; else what went wrong."""
        prompt_ids, ref_ids = self.greedy_ids(prompt, max_tokens)
        if text == self.codec.decode(ref_ids):
            return None
        for j in range(len(ref_ids)):
            if not text.startswith(stable_text(self.codec.decode(ref_ids[: j + 1]), final=False)):
                gap = self.top2_gap(prompt_ids + ref_ids[:j])
                if gap < TIE_TOLERANCE:
                    return None
                return f"{prompt!r}: diverges at output token {j} (top-2 gap {gap:.2e}): {text!r}"
        return f"{prompt!r}: longer than the reference {self.codec.decode(ref_ids)!r}: {text!r}"
