"""Running on many processes: who this process is, its share of the host, joining the group, the job secret.

distributed.py     rank awareness (World): rank, device, backend, who prints, the few collectives
process_group.py   joining the process group under a fresh store prefix, within the timeout, with the job secret
cores.py           each process's compute threads on CPU: its share of its host's cores
secret.py          the job secret and its proofs (HMAC): the one module every check of it uses
object_server.py   the S3 server (SeaweedFS) the project runs for its snapshots: its one command line, its keys
solo.py            a node of one standalone training process, started and restarted by app.launch without torch
"""
