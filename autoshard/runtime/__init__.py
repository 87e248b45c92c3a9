"""One rank's driver: its components set up in order and one training step (rank.py), the holders of each
ZeRO stage (holders.py, zero.py, masters.py), flat groups (flat.py), tensor parallelism's group
(tensor_parallel.py), the pipeline schedule's runner (pipeline.py), torch.compile of the rank graphs
(compiled.py), forward-only calls (forward.py), and the user's optimizer (optim.py)."""
