"""Comparisons: presets that return run configurations, sweeps over attention kinds, summaries, plots and the paper's tables."""
