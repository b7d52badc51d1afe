"""Checkpoints, collectives, data, EMA, metrics, plots, sample grids, memory accounting."""
