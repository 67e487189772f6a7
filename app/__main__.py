from app.recovery import failures
from app.train import run

failures.exit_process(run())    # the trainer's one way out (failures.exit_process says why)
