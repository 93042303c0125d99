"""Run the OpenAI-compatible server: ``python -m specdec_openai --triton-url localhost:8001 --port 9000``.

``--exit-with PID`` ends the server when that process is gone: ``scripts/serve.sh``
starts this server and then becomes ``tritonserver`` (``exec``), so the two stop
together however Triton stops.

``--api-key`` (or ``SPECDEC_OPENAI_API_KEY``, or vLLM's ``VLLM_API_KEY``) makes every
``/v1`` request carry ``Authorization: Bearer <key>``. Prefer an environment variable:
a command line is visible to every user of the machine in ``ps``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from specdec_openai.app import MODELS, ServerConfig, create_app
from specdec_openai.auth import KEY_ENV_VARS, api_key_from
from specdec_openai.chat import read_template
from specdec_openai.triton import CONNECT_TIMEOUT_S

POLL_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec_openai", description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC endpoint, host:port")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model", action="append", dest="models", choices=MODELS,
                        help=f"served model (the Triton model it calls); repeatable; default: {', '.join(MODELS)}")
    parser.add_argument("--tokenizer", help="directory with the target's tokenizer, for the chat template "
                        "(default: the directory Triton's tokenizer model loaded)")  # fmt: skip
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding one "
                        "(default: the tokenizer's own)")  # fmt: skip
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests "
                        f"(default: ${' or $'.join(KEY_ENV_VARS)}; none: open); an environment variable "
                        "keeps it out of ps")  # fmt: skip
    parser.add_argument("--triton-connect-timeout", type=_positive, default=CONNECT_TIMEOUT_S, metavar="SECONDS",
                        help="how long a request waits for the gRPC connection to Triton before a 503")  # fmt: skip
    parser.add_argument("--exit-with", type=int, metavar="PID", help="stop when this process exits")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser.parse_args(argv)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got '{text}'")
    return value


async def _watch(pid: int, server) -> None:
    """Ask uvicorn to stop once ``pid`` is gone (or is no longer this process's parent)."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(POLL_S)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        if pid == parent and os.getppid() != parent:  # reparented: the parent exited and its pid may be reused
            break
    print(f"[specdec_openai] process {pid} exited; stopping", file=sys.stderr, flush=True)
    server.should_exit = True


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    try:  # a missing file fails here, not at the first chat request
        template = read_template(args.chat_template) if args.chat_template is not None else None
    except ValueError as err:
        raise SystemExit(f"[specdec_openai] --chat-template: {err}") from None
    try:
        api_key, key_source = api_key_from(args.api_key, os.environ)
    except ValueError as err:
        raise SystemExit(f"[specdec_openai] {err}") from None
    config = ServerConfig(
        triton_url=args.triton_url,
        models=tuple(dict.fromkeys(args.models)) if args.models else MODELS,
        tokenizer_dir=args.tokenizer,
        chat_template=template,
        connect_timeout_s=args.triton_connect_timeout,
        api_key=api_key,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port,
                                           log_level=args.log_level))  # fmt: skip
    watcher = asyncio.create_task(_watch(args.exit_with, server)) if args.exit_with else None
    access = f"API key required (from {key_source})" if api_key is not None else "no API key: open to every client"
    print(f"[specdec_openai] OpenAI API on http://{args.host}:{args.port}/v1 -> Triton gRPC {args.triton_url}; "
          f"{access}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if not server.started:
        raise SystemExit(f"[specdec_openai] could not start on {args.host}:{args.port} (see the error above)")


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_serve(parse_args(argv)))


if __name__ == "__main__":
    main()
