"""The chaos runner, `python -m scripts.chaos` (`make chaos`): faults injected into a container job, measured."""
