"""What travels between client and workers and what is kept: record kinds, the control state, metrics
and their relay, the run directory, the checkpoint format."""
