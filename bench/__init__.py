"""The benchmark harness: ``scripts/benchmark.py`` and ``tests/e2e`` run the server through it.

A top-level package, not part of ``specdec``: it talks to ``tritonserver`` with
``tritonclient``, which the engine never imports.

* :mod:`bench.workload` -- held-out prompts (the training script's split);
* :mod:`bench.stats` -- streaming latency figures, acceptance, Prometheus and
  Triton statistics deltas;
* :mod:`bench.bound` -- the analytic speedup bound and step-time measurement;
* :mod:`bench.results` -- rows: speedup over the right baseline, bound, efficiency,
  outputs compared with the reference;
* :mod:`bench.report` -- the machine description and the markdown table;
* :mod:`bench.repository` -- model repository variants (``config.pbtxt`` edits);
* :mod:`bench.server` / :mod:`bench.client` / :mod:`bench.hf` --
  running the server, streaming requests to it, and the in-process Hugging Face baselines;
* :mod:`bench.engine` -- the step scheduler over in-process stages, no server
  (``scripts/benchmark_engine.py``, where no ``tritonserver`` runs: a lent GPU); its
  configurations (:mod:`bench.engine_configs`, ``+json`` under a guide included) and rows
  (:mod:`bench.engine_rows`).
"""
