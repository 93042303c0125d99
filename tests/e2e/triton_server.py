"""A tritonserver run by scripts/serve.sh on free ports, repository copies, and the target as a reference."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from specdec.detokenize import stable_text
from specdec_triton.text import TextCodec

REPO_ROOT = Path(__file__).resolve().parents[2]

READY_TIMEOUT_S = 300  # six Python stubs importing torch on a busy 2-core machine take a while
STOP_TIMEOUT_S = 60
MODEL_PATH_KEYS = ("target_model", "draft_model", "tokenizer_dir")
TIE_TOLERANCE = 1e-4  # top-2 logit gap below which either token is a correct greedy choice


def models_dir() -> Path:
    return Path(os.environ.get("SPECDEC_E2E_MODELS", REPO_ROOT / "models"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def command(self) -> list[str]:
        return [
            str(REPO_ROOT / "scripts" / "serve.sh"),
            f"--model-repository={self.repository}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
        ]

    def _launch(self) -> None:
        with open(self.log_path, "w") as log:  # the child keeps its own handle
            # Its own session, so that a hung server can be killed with its stubs and nothing else.
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start(self) -> None:
        """Start the server and wait until it is ready; fails the test with the log if it is not."""
        self._launch()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"tritonserver exited with {self.process.returncode}; log:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(1)
        self.stop()
        pytest.fail(f"tritonserver not ready after {READY_TIMEOUT_S} s; log:\n{self.log_tail()}")

    def run_until_exit(self, timeout_s: float = READY_TIMEOUT_S) -> int:
        """Start the server and wait for it to exit by itself (a repository that must fail to load)."""
        self._launch()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"tritonserver still running after {timeout_s} s; log:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # graceful: unloads models, ends the stubs
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Prometheus samples as {(name, sorted label pairs): value}."""
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if match:
                labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")))
                samples[(match.group(1), labels)] = float(match.group(3))
        return samples


def _set_parameter(text: str, key: str, value: Callable[[str], str]) -> str:
    """``config.pbtxt`` text with parameter ``key``'s value replaced by ``value(old value)``."""
    pattern = rf'(key: "{key}" value: {{ string_value: ")([^"]*)"'
    return re.sub(pattern, lambda match: f'{match.group(1)}{value(match.group(2))}"', text)


def configured_parameter(model_dir: Path, key: str) -> str:
    """The string value of parameter ``key`` in ``model_dir/config.pbtxt``."""
    text = (model_dir / "config.pbtxt").read_text()
    match = re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)"', text)
    if match is None:
        raise KeyError(f"{model_dir / 'config.pbtxt'} sets no parameter {key!r}")
    return match.group(1)


def repository_copy(
    destination: Path, models: Path, method: str, only: tuple[str, ...] = (), parameters: dict[str, str] | None = None
) -> Path:
    """The committed repository (or just the models in ``only``) with model paths pointing into
    ``models``, the proposer method set, and any other ``parameters`` (key -> value) replaced."""
    repository = destination / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository)
    for model in repository.iterdir():
        if only and model.name not in only:
            shutil.rmtree(model)
    for config in repository.glob("*/config.pbtxt"):
        text = config.read_text()
        for key in MODEL_PATH_KEYS:
            text = _set_parameter(text, key, lambda old: str(models / Path(old).name))
        for key, value in {"method": method, **(parameters or {})}.items():
            text = _set_parameter(text, key, lambda old, value=value: value)
        config.write_text(text)
    return repository


def server_on_free_ports(workdir: Path, repository: Path) -> Server:
    """A server on free ports, not started."""
    return Server(_free_port(), _free_port(), _free_port(), repository, workdir / "tritonserver.log")


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
