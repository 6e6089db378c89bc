"""The verdict as a function of the journal: `judge.py` runs the oracles and the run-level gates
over a run's journal and nothing else; `chaos/run_evidence.py` is what the runner journals for
them beside the requests and the fault steps."""
