"""qship's benchmark harness: `python -m bench list`, `python -m bench run SUITE`."""
