"""The run record: FLOPs and formatting (`metrics.py`), the metrics sinks — jsonl, wandb, TensorBoard, the
progress line — (`sinks.py`), the run's log and summary (`runlog.py`), a logged step's figures (`report.py`, with
the `comm/` and `time/` figures of `comm_report.py` and the rank-to-rank bytes of `traffic_map.py`) and
`profile.steps` traces (`profiling.py`)."""
