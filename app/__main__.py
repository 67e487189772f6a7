import sys

from app.train import run

sys.exit(run())
