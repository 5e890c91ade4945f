"""The quick benchmarks behind ``python -m mlx_knorm`` and ``mlx-knorm bench``:
native kernel vs pure-MLX fallback vs the reference package vs a memcpy
floor, on decode and prefill steps; with ``--cache``, one decode step of
mlx-lm's caches, the reference's and ours.

- ``cases``: the cases and their inputs;
- ``timing``: how a case is timed (warm process, page faults), and a suite run;
- ``progress``: the progress bar;
- ``report``: the speed targets, tables and machine description;
- ``plot``: time vs budget and vs S;
- ``cache_step``, ``cache_report``: the cache-step benchmark and its report;
- ``cli``: the command line.

The sweeps behind docs/benchmarks.md's plot and tables are ``bench/ops.py`` and
``bench/cache_step.py`` in a checkout.
"""
