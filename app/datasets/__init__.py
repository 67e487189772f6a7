"""The training data: where datasets live on disk, and the in-memory datasets the loop reads.

files.py   where datasets live, decoding CIFAR-format files once, digits made offline (imports no other app module)
data.py    in-memory datasets (memory-mapped decoded files), the resumable sampler, augmentation
"""
