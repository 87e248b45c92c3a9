"""What a captured graph carries: the node.meta contract (meta.py), the op sets passes and the runtime share
(ops.py), placements along each mesh dimension (placements.py), whole-model costs (cost.py), and the dtypes
autocast gives each value (autocast.py)."""
