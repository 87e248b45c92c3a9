"""The functions passes insert into rank graphs: tensor-parallel collectives and vocab-parallel ops (tp.py),
ZeRO-3's gather and mark (zero.py), pipeline boundaries (pipeline.py), single-device dropout masks
(masks.py), recompute regions (recompute.py). Each takes the rank's runtime module first (a get_attr node:
``tp``, ``zero3``, ``pipe``, ``masks``), which the runtime binds; passes import these, never the runtime."""
