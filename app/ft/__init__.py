"""The modes whose survivors keep training through a fault (--ft torchft, --ft inplace).

trainer.py     the step loop both run: a membership check around every step, healing from a live node
membership.py  the interface both modes' membership implements for that loop (a Protocol)
torchft mode, every node one replica group:
lighthouse.py  the quorum service every replica group reports to (run beside the rendezvous store)
replica.py     one replica group's torchft Manager: quorum per step, fault-tolerant all-reduce, commit
transport.py   the state a returning replica group copies from a live one, refused without the job secret
inplace mode, every process one member, on torch's own c10d:
inplace.py     generations of a c10d group re-formed in place when a member goes or comes
groups.py      a generation's group per backend: gloo on CPU; NCCL on CUDA, polled, aborted, bounded
both:
writer.py      which node writes a shared directory: a lease a hung writer loses
"""
import os

# torchft's Rust side logs every quorum and commit at info, and reads this once, at its first import.
os.environ.setdefault("RUST_LOG", "warn")
