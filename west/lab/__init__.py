"""The lab: instruments for finding out why a step takes the time it takes (host clocks, phase marks,
operator timings, kernel gaps, rooflines, stack samples). No product module imports this package
(tests/test_west_imports.py says so): a plain west-train or west-benchmark run reads no host clock.
Tools attach its observers to a west-train run with ``python -m west.lab.train``; docs/notebook.md
keeps what they found."""
