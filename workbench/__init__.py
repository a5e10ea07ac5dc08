"""Training workbench: data-parallel PyTorch training on a Dask cluster, with selectable strategies.

    import workbench
    client = workbench.connect(workers=2)
    run = workbench.train(workbench.Job(model=..., data="digits"), strategy="average", client=client, period=4)
    run.wait(); run.evaluate()

This package is the engine; it never imports the UI (`widgets`). The UI registers its notebook display
of a run and its `workbench dashboard` command through entry points (`extensions.py`).
"""
from .cluster import client_session, connect, security_from_files, shutdown
from .data import Splits, digits, stdlib_text, synthetic
from .errors import ClusterError, ConfigError, DivergenceError, ResumeError, TrainingError, WorkbenchError
from .job import Job
from .models import GPT_SIZES, gpt, mlp
from .run import Run, resume, train
from .strategies import STRATEGIES

__all__ = [
    "GPT_SIZES", "STRATEGIES", "ClusterError", "ConfigError", "DivergenceError", "Job", "ResumeError", "Run", "Splits",
    "TrainingError", "WorkbenchError", "client_session", "connect", "digits", "gpt", "mlp", "resume",
    "security_from_files", "shutdown", "stdlib_text", "synthetic", "train",
]
