"""How a fault is found and how a process leaves: lost and hung peers, background threads that fail,
the stacks of a hang, and the exits they lead to. The timings they run on are not here: the fault
policy (FaultPolicy, app/core/policy.py) owns every one.

heartbeat.py   hung peers and stuck ranks found in seconds
silence.py     when a beating peer counts as gone: the one silence detector (heartbeat, inplace)
failures.py    a lost peer told from a bug; the exit statuses; the line left for the launcher
stacks.py      the Python stacks of a hang (faulthandler), written to runs/X/hangs
threads.py     every background thread's start: what it does not handle ends the node in one line
"""
