"""What every part shares: the one validated Config and the error every part raises for bad input.

config.py   one validated Config from flags and TRAIN_* variables; per-dataset defaults
errors.py   UserError (bad input: restarting cannot help) and the one-line report of it
"""
