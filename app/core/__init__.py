"""What every part shares: the one validated Config, the fault-timing budget it holds, and the error every
part raises for bad input.

config.py   one validated Config from flags and TRAIN_* variables; per-dataset defaults
errors.py   UserError (bad input: restarting cannot help) and the one-line report of it
policy.py   the fault-timing budget (FaultPolicy): every number that decides how fast a fault is found and
            recovered from
"""
