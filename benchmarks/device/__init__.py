"""The device wing: the time-boxed GPU run, `python -m benchmarks.device` (its __main__), and its checks."""
