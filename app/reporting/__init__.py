"""What a run tells its user: console lines, metrics.jsonl, TensorBoard, start-up and goodput accounting.

metrics.py   Reporter: rank 0's console lines, warnings, metrics.jsonl and TensorBoard (tboard.py)
tboard.py    the TensorBoard writer behind the Reporter
startup.py   where a process's start-up seconds go (the start row's startup_s)
goodput.py   where a process life's and the job's time went: the goodput row and the done line's fraction
"""
