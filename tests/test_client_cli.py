"""The command-line client without a server says so in one line, naming the address and --url."""
from __future__ import annotations

import pytest

from bench.server import free_port
from client.generate import main


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_no_server_is_one_line_naming_the_url(protocol, capsys):
    url = f"localhost:{free_port()}"
    assert main(["Hello", "--protocol", protocol, "--url", url]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "--url" in err and "Traceback" not in err
