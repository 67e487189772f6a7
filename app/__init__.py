"""Fault-tolerant DDP training of ResNets on CIFAR: config -> data -> model -> loop -> snapshot."""
