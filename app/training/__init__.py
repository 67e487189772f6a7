"""The training loop and what it owns: model, optimizer, one step, evaluation, snapshots.

trainer.py    the loop: epochs, logging, evaluation and snapshot points; its public hooks are what the survivor modes extend
state.py      TrainingState: model, optimizer, schedule, scaler, RNG, position; what a snapshot or a heal holds
step.py       one optimizer step (DDP, accumulation, autocast, fused optimizer): no host sync in it
evaluate.py   the test set scored shard by shard, summed on the device
models.py     ResNets with a CIFAR stem, a tiny CNN
optim.py      optimizer and the epoch-based warmup + cosine schedule
snapshot.py   snapshots: when one is due, atomic step-N folders, newest-anywhere restore; the Writer
snapshot_files.py  a snapshot on disk: the step-N folder, its safetensors parts, its manifest (no torch)
saver.py      the snapshot saver process: writes, prunes and uploads, off the training process
object_store.py    the snapshots' second home in an S3 bucket: upload, commit, download, prune (no torch)
"""
