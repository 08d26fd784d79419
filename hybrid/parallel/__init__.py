"""Parallelism: the mesh, region collectives, TP layers, pipeline schedules, DP gradient sync."""
