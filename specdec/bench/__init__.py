"""Benchmark support for ``scripts/benchmark.py``: the pure parts, importable and unit-tested.

* :mod:`specdec.bench.workload` -- held-out prompts (the training script's split);
* :mod:`specdec.bench.stats` -- streaming latency figures, acceptance, Prometheus and
  Triton statistics deltas;
* :mod:`specdec.bench.bound` -- the analytic speedup bound and step-time measurement;
* :mod:`specdec.bench.results` -- rows: speedup over the right baseline, bound, efficiency,
  outputs compared with the reference;
* :mod:`specdec.bench.report` -- the machine description and the markdown table;
* :mod:`specdec.bench.repository` -- model repository variants (``config.pbtxt`` edits);
* :mod:`specdec.bench.server` / :mod:`specdec.bench.client` / :mod:`specdec.bench.hf` --
  running the server, streaming requests to it, and the in-process Hugging Face baselines.
"""
