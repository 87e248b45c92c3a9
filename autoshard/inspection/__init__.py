"""Looking at a compiled program: ``explain()`` (explain.py), the HTML report (report.py, html.py), training
metrics (metrics.py), and ``autoshard.verify`` node by node against one device (verify.py, node_values.py)."""
