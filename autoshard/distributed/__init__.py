"""torch.distributed as autoshard uses it: collectives counted (comm.py), functional collectives over a group's
name (funcol.py), process groups made once per process (groups.py), profiler spans (tracing.py), and gloo
through host memory for ranks that share a GPU (gloo_via_host.py)."""
