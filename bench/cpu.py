"""Where the CPU goes during a load: CPU seconds of a server's processes and of the machine (Linux ``/proc``).

A served repository is a ``tritonserver`` process plus one Python backend stub per
model; on a small machine they compete for the same cores, so the question "which
model is the bottleneck" is answered by CPU time per process, next to how busy the
machine was as a whole.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def process_label(cmdline: list[str]) -> str:
    """A Python backend stub by the model it serves (its first argument is ``<repo>/<model>/<version>/model.py``)."""
    if not cmdline:
        return "?"
    program = Path(cmdline[0]).name
    if program == "triton_python_backend_stub" and len(cmdline) > 1:
        parts = Path(cmdline[1]).parts
        return parts[-3] if len(parts) >= 3 else cmdline[1]
    return program


def _cmdline(pid: int) -> list[str]:
    raw = (PROC / str(pid) / "cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def process_tree(root_pid: int) -> dict[int, str]:
    """``{pid: label}`` of ``root_pid`` and all its descendants."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root_pid], [root_pid]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree.extend(frontier)
    labels = {}
    for pid in tree:
        try:
            labels[pid] = process_label(_cmdline(pid))
        except OSError:
            pass
    return labels


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads) so far."""
    fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_idle() -> tuple[int, int]:
    """Clock ticks the whole machine spent busy and idle so far (``/proc/stat``, all cores)."""
    values = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle, idle


@dataclass
class CpuSnapshot:
    processes: dict[int, tuple[str, float]]  # pid -> (label, CPU seconds)
    busy: int
    idle: int

    @classmethod
    def take(cls, labels: dict[int, str]) -> CpuSnapshot:
        processes = {}
        for pid, label in labels.items():
            try:
                processes[pid] = (label, cpu_seconds(pid))
            except OSError:
                pass
        return cls(processes, *machine_busy_idle())

    def until(self, later: CpuSnapshot) -> tuple[dict[str, float], float]:
        """CPU seconds per label between the two snapshots, and the machine's busy fraction."""
        per_label: dict[str, float] = {}
        for pid, (label, seconds) in later.processes.items():
            if pid in self.processes:
                per_label[label] = per_label.get(label, 0.0) + seconds - self.processes[pid][1]
        busy, idle = later.busy - self.busy, later.idle - self.idle
        return per_label, busy / (busy + idle) if busy + idle else 0.0
