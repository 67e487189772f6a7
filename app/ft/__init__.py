"""torchft mode (--ft torchft): every node is one replica group; the survivors of a fault keep training.

lighthouse.py  the quorum service every replica group reports to (run beside the rendezvous store)
replica.py     one replica group's torchft Manager: quorum per step, fault-tolerant all-reduce, commit
transport.py   the state a returning replica group copies from a live one, refused without the job secret
"""
import os

# torchft's Rust side logs every quorum and commit at info, and reads this once, at its first import.
os.environ.setdefault("RUST_LOG", "warn")
