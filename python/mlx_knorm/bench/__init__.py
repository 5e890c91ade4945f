"""The quick benchmark behind ``python -m mlx_knorm`` and ``mlx-knorm bench``:
native kernel vs pure-MLX fallback vs the reference package vs a memcpy
floor, on decode and prefill steps.

- ``cases``: the cases and their inputs;
- ``timing``: how a case is timed (warm process, page faults), and a suite run;
- ``progress``: the progress bar;
- ``report``: the speed targets, tables and machine description;
- ``plot``: time vs budget and vs S;
- ``cli``: the command line.

The sweeps behind README's plot are ``bench/ops.py`` in a checkout.
"""
