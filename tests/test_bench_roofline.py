"""bench/roofline.py: the memory-bandwidth floor."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.roofline import floor_ms, memory_bandwidth_gbps, target_over_floor, weight_bytes_per_step
from specdec.models import load_causal_lm


SHIPPED_TARGET = Path(__file__).resolve().parent.parent / "models" / "tiny-target"


def test_weight_bytes_leave_out_an_untied_input_embedding_and_count_a_tied_one_once(tiny_llama):
    untied = tiny_llama(seed=0)  # vocab 256 x hidden 64, untied
    everything = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert weight_bytes_per_step(untied) == everything - 256 * 64 * 4
    tied = load_causal_lm(SHIPPED_TARGET, dtype="float32", device="cpu")  # tied input and output embeddings
    assert tied.get_output_embeddings().weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    # vocab 4096 x hidden 256 once; 6 layers of q, k, v, o (256 x 256), MLP 3 x 256 x 704 and two norms; final norm
    assert weight_bytes_per_step(tied) == 4 * (4096 * 256 + 6 * (4 * 256 * 256 + 3 * 256 * 704 + 2 * 256) + 256)


def test_floor_and_step_times_over_it():
    assert floor_ms(2_000_000, 1.0) == pytest.approx(2.0)  # 2 MB at 1 GB/s
    summary = target_over_floor(2_000_000, 1.0, {"target_1": 3.0, "target_5": 5.0, "draft_1": 1.0})
    assert summary["floor_ms"] == pytest.approx(2.0)
    assert summary["over_floor"] == {"target_1": pytest.approx(1.5), "target_5": pytest.approx(2.5)}
    with pytest.raises(ValueError, match="bandwidth > 0"):
        floor_ms(1, 0.0)


def test_memory_bandwidth_is_measured_and_checks_its_arguments():
    assert memory_bandwidth_gbps("cpu", buffer_mb=8, repeats=3) > 0
    with pytest.raises(ValueError, match="buffer_mb and repeats must be >= 1"):
        memory_bandwidth_gbps("cpu", buffer_mb=0)
