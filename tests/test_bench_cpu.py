"""bench/cpu.py: CPU time per process (Linux /proc)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu import CpuSnapshot, process_label, process_tree


def test_process_labels_name_the_model_a_stub_serves():
    stub = ["/x/backends/python/triton_python_backend_stub", "/tmp/repo/target_verifier/1/model.py", "1", "2"]
    assert process_label(stub) == "target_verifier"
    assert process_label(["/usr/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    assert process_label([]) == "?"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")
def test_cpu_snapshots_cover_a_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        labels = process_tree(os.getpid())
        assert child.pid in labels and os.getpid() in labels
        before = CpuSnapshot.take(labels)
        sum(i * i for i in range(200_000))  # some CPU in this process
        per_label, busy = before.until(CpuSnapshot.take(labels))
        assert all(seconds >= 0 for seconds in per_label.values()) and 0.0 <= busy <= 1.0
    finally:
        child.kill()
        child.wait()
