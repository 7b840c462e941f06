"""Parallelism beyond data parallelism, on torch's DTensor: the run's named device mesh (``mesh``), tensor /
sequence parallelism applied from outside the model by each model's own plan (``tensor``) and context parallelism
(``context``). See ``docs/parallelism.md``."""
