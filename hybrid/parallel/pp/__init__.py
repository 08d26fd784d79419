"""Pipeline parallelism: the action vocabulary and placements (`actions.py`), the schedule registry
(`schedules.py`), the virtual-clock simulator (`simulator.py`), the zero-bubble input and weight passes
(`split_backward.py`) and the executor with its point-to-point communication (`pipeline.py`)."""
