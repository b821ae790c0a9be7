"""kvtrace experiment: matrix (cells), runner (server lifecycle), analysis (per-run metrics, factor effects), report."""
