"""Run the OpenAI-compatible server: ``python -m specdec_openai --triton-url localhost:8001 --port 9000``.

``--exit-with PID`` ends the server when that process is gone: ``scripts/serve.sh``
starts this server and then becomes ``tritonserver`` (``exec``), so the two stop
together however Triton stops.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

from specdec_openai.app import MODELS, ServerConfig, create_app
from specdec_openai.chat import read_template

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
    parser.add_argument("--exit-with", type=int, metavar="PID", help="stop when this process exits")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser.parse_args(argv)


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
    config = ServerConfig(
        triton_url=args.triton_url,
        models=tuple(dict.fromkeys(args.models)) if args.models else MODELS,
        tokenizer_dir=args.tokenizer,
        chat_template=template,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port,
                                           log_level=args.log_level))  # fmt: skip
    watcher = asyncio.create_task(_watch(args.exit_with, server)) if args.exit_with else None
    print(f"[specdec_openai] OpenAI API on http://{args.host}:{args.port}/v1 -> Triton gRPC {args.triton_url}",
          file=sys.stderr, flush=True)  # fmt: skip
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
