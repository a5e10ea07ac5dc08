"""Training workbench: data-parallel PyTorch training on a Dask cluster, with selectable strategies.

    import workbench
    client = workbench.connect(workers=2)
    run = workbench.train(workbench.Job(model=..., data="digits"), strategy="average", client=client, period=4)
    run.wait(); run.evaluate()

This package is the engine; it never imports the UI (`widgets`). The UI registers its notebook display
of a run and its `workbench dashboard` command through entry points (`extensions.py`).
"""
from workbench.cluster.connection import client_session, connect, security_from_files, shutdown
from workbench.data import Splits, digits, stdlib_text, synthetic
from workbench.errors import ClusterError, ConfigError, DivergenceError, ResumeError, TrainingError, WorkbenchError
from workbench.job import Job
from workbench.models import GPT_SIZES, gpt, mlp
from workbench.run.handle import Run, resume, train
from workbench.strategies import STRATEGIES

__all__ = [
    "GPT_SIZES", "STRATEGIES", "ClusterError", "ConfigError", "DivergenceError", "Job", "ResumeError", "Run", "Splits",
    "TrainingError", "WorkbenchError", "client_session", "connect", "digits", "gpt", "mlp", "resume",
    "security_from_files", "shutdown", "stdlib_text", "synthetic", "train",
]
