"""``qkv.check(obj, flash=True)`` (``--flash``): grade a flash attention against float64 in out,
lse and gradients, and for linear memory and skipped causal work. Its modules, one job each:

- ``target``: calling a function or ``autograd.Function``; ``context``: what the checks share;
  ``oracle``: the float64 truth and the usual flash mistakes.
- ``checks``, ``edges`` and ``cost``: the eleven checks; ``run``: all of them on one
  implementation.

Comparison, results and the report are the module grader's (``checker.compare``,
``checker.report``).
"""
