"""What the benchmarks use and the serving path never does: request traces, replaying them against a
cluster, the statistics of a run and its plots."""
