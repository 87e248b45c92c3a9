"""What the user asks for, as printable data: the Mesh (mesh.py), the Plan (plan.py), pipeline schedules
(schedules.py: the data and its validator; schedule_builders.py: the named ones), and the torch.compile
request (torch_compile.py)."""
