"""A run's safety: the output-folder lock, resume, run config, signals, finite checks, errors."""
