"""The `workbench` command: `workbench train ...` runs a job with a live progress bar and a summary;
`workbench dashboard ...` serves the team dashboard: a command the UI adds through the
`workbench.commands` entry point (`extensions.py`), imported only when it is run.

Bad arguments end with a one-line message and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

import torch
from tqdm import tqdm

from workbench import extensions
from workbench.checks import check_number, check_positive_int, check_positive_number
from workbench.cli.arguments import EXIT_BAD_INPUT, OneLineParser, add_tls_arguments, tls_security
from workbench.cli.setting_flags import add_setting_flags, chosen_settings
from workbench.cluster import connection as cluster_module
from workbench.data import as_source, resolve_dataset, stdlib_text
from workbench.errors import ConfigError, WorkbenchError
from workbench.job import DEVICES, OPTIMIZERS, PRECISIONS, Job
from workbench.models import GPT_SIZES, gpt, mlp
from workbench.plane import checkpoint_format as checkpoints, deadline, kinds
from workbench.run.autopilot import AUTO, START as AUTO_START
from workbench.run import recovery
from workbench.run.handle import resume, train
from workbench.run.launcher import check_world
from workbench.plane.link import limit_text
from workbench.schedule import SCHEDULES
from workbench.strategies import STRATEGIES, get_strategy, make_settings, suggested_sgd

EXIT_FAILED = 1
BUILT_IN_COMMANDS = ("train",)


def build_parser(describe_added: bool = False) -> argparse.ArgumentParser:
    """The `workbench` parser. `describe_added`: import the added commands to list them with their
    summaries (for --help only: the dashboard's imports cost seconds)."""
    parser = OneLineParser(prog="workbench", description="Data-parallel PyTorch training on Dask.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = commands.add_parser("train", help="train a model on the embedded cluster or an existing one")
    run.add_argument("--strategy", default="allreduce", choices=sorted(STRATEGIES) + [AUTO],
                     help="how workers combine results ('auto': chosen and changed while the run trains)")
    run.add_argument("--workers", type=_positive_int, default=2, help="worker processes that train (default 2)")
    run.add_argument("--epochs", type=_positive_int, default=None, help="passes over each worker's shard (default 5)")
    run.add_argument("--steps", type=_positive_int, default=None, help="total steps per worker, instead of --epochs")
    run.add_argument("--lr", type=_positive_float, default=None,
                     help="learning rate (default: the strategy's: 0.5 for async/ssp, 0.1 for the others with sgd, "
                          "0.001 with adam/adamw)")
    run.add_argument("--momentum", type=float, default=None,
                     help="SGD momentum (default: the strategy's: 0 for async/ssp, 0.9 for the others)")
    run.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                     help="default: adamw for a GPT, sgd for the MLP")
    run.add_argument("--batch-size", type=_positive_int, default=32, help="samples per step on each worker")
    add_setting_flags(run)  # --period, --push-every, ...: one per setting of every strategy
    run.add_argument("--dataset", default="digits",
                     help="'digits', 'synthetic', 'stdlib-text' (this Python's standard library source, as bytes, for "
                          "a character-level GPT) or 'module:function'")
    run.add_argument("--model", default=None, choices=["mlp", *GPT_SIZES],
                     help="the MLP (default for classification data) or a GPT size (default gpt-mini for stdlib-text)")
    run.add_argument("--context", type=_positive_int, default=None,
                     help="stdlib-text: bytes per sample window (default: the GPT's positions)")
    run.add_argument("--hidden", type=_positive_int, nargs="*", default=[128], help="hidden layer sizes of the MLP")
    run.add_argument("--lr-schedule", default=None, choices=SCHEDULES,
                     help="learning rate over the run (default: cosine for a GPT; for the MLP with sgd the strategy's: "
                          "cosine for async/ssp, constant for the others; else constant)")
    run.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                     help="steps of linear learning-rate warm-up (default: 5%% of the run for a GPT, 0 for the MLP)")
    run.add_argument("--compile", action="store_true", help="compile the model's forward pass (torch.compile)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="auto", choices=DEVICES, help="where workers train (auto: CUDA where they have a GPU)")
    run.add_argument("--precision", default="float32", choices=PRECISIONS,
                     help="bf16: the forward pass under bfloat16 autocast (weights and optimizer stay float32)")
    run.add_argument("--scheduler", default=None, metavar="ADDRESS", help="train on an existing cluster")
    add_tls_arguments(run)
    run.add_argument("--run-dir", default="runs", help="where the run's directory is created")
    run.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="go on with a stopped or crashed run from its checkpoint (its job and strategy)")
    run.add_argument("--checkpoint-every-steps", type=_positive_int, default=None, help="steps between checkpoints")
    run.add_argument("--checkpoint-every-s", type=_positive_float, default=60.0, help="seconds between checkpoints")
    run.add_argument("--min-workers", type=_positive_int, default=1,
                     help="after losing workers, go on only with at least this many")
    run.add_argument("--auto-join", action="store_true", help="add workers that join the cluster during the run")
    run.add_argument("--queue", action="store_true",
                     help="on a shared cluster, wait for enough free workers instead of being refused")
    run.add_argument("--timeout", type=_positive_float, default=None, dest="collective_timeout_s",
                     help="seconds any wait on another worker may take before that worker counts as lost "
                          "(default: measured, 10 times the longest step or exchange, within 15 s and 30 min)")
    run.add_argument("--tensorboard", nargs="?", const=True, default=False, metavar="DIR",
                     help="export live to TensorBoard event files: in the run's directory, or under DIR")
    run.add_argument("--mlflow", nargs="?", const=True, default=False, metavar="URI",
                     help="export live to MLflow: MLFLOW_TRACKING_URI or sqlite:///mlflow.db here, or URI")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--oversubscribe", action="store_true",
                     help="start more local workers than this machine's cores and memory hold")
    for name in sorted(set(extensions.declared(extensions.COMMANDS)) - set(BUILT_IN_COMMANDS)):
        commands.add_parser(name, add_help=False, help=_added_command_help(name, describe_added))
    return parser


def _added_command_help(name: str, describe: bool) -> str:
    """'<first line of its docstring> (workbench NAME --help)', or only the pointer when not described."""
    summary = ""
    if describe:
        try:
            summary = (extensions.load(extensions.COMMANDS, name).__doc__ or "").strip().split("\n")[0].rstrip(".")
        except ImportError:
            summary = "needs the UI extra"
    summary = summary[:1].lower() + summary[1:]
    return f"{summary} (workbench {name} --help)" if summary else f"workbench {name} --help"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in BUILT_IN_COMMANDS and argv[0] in extensions.declared(extensions.COMMANDS):
        # A command another package adds (the UI's dashboard), imported only when asked for: the engine
        # imports no UI, and `workbench train` does not wait for Panel to load.
        try:
            command = extensions.load(extensions.COMMANDS, argv[0])
        except ImportError as error:
            print(f"workbench {argv[0]}: needs the UI extra (pip install 'training-workbench[ui]'): {error}",
                  file=sys.stderr)
            return EXIT_FAILED
        return command(argv[1:])
    parser = build_parser(describe_added=argv[:1] in (["-h"], ["--help"]))
    arguments = parser.parse_args(argv)  # argparse prints a one-line usage error and exits 2
    # A terminated command (a timeout, a job scheduler) cleans up as an interrupted one does: the run
    # stops, and the cluster it started is closed, however far its start-up got.
    # Ctrl-C too goes through `_interrupt`, which remembers it: a KeyboardInterrupt raised inside code that
    # swallows it (a finalizer run while the cluster starts: "Exception ignored in ...") still ends the
    # command as interrupted at its next check, instead of training on and exiting 0 (seen in the suite).
    in_main_thread = threading.current_thread() is threading.main_thread()
    _INTERRUPTED.clear()
    # An ignored SIGINT stays ignored (a command started in the background of a shell).
    handled = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    previous = {s: signal.signal(s, _interrupt) for s in handled} if in_main_thread else {}
    try:
        status = _train(arguments)
        _raise_if_interrupted()
        return status
    except WorkbenchError as error:
        # Bad input in one line; a failed run in full (what failed where, and how to go on).
        text = f"{error}".splitlines()[0] if isinstance(error, ValueError) else f"{error}".strip()
        print(f"workbench: error: {text}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(error, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        print("workbench: interrupted", file=sys.stderr)
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_INTERRUPTED = threading.Event()


def _interrupt(signum: int, frame: Any) -> None:
    _INTERRUPTED.set()
    raise KeyboardInterrupt(f"signal {signum}")


def _raise_if_interrupted() -> None:
    """An interrupt some code swallowed, raised again where the command can act on it."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt("interrupted earlier")


def _train(arguments: argparse.Namespace) -> int:
    fault_tolerance = {name: getattr(arguments, name) for name in FAULT_TOLERANCE_FLAGS}
    exports = {name: getattr(arguments, name) for name in EXPORT_FLAGS}
    if arguments.resume is not None:
        checkpoints.load(arguments.resume)  # refuse a directory without a checkpoint before starting a cluster
        given = {name: value for name, value in exports.items() if value is not False}
        return _with_client(arguments, lambda client: resume(arguments.resume, client=client,
                                                             workers=arguments.workers, **fault_tolerance,
                                                             **given))
    text = arguments.dataset == "stdlib-text"
    model_name = arguments.model or ("gpt-mini" if text else "mlp")
    if text and model_name == "mlp":
        raise ConfigError("--model", model_name, f"a GPT size for stdlib-text ({', '.join(GPT_SIZES)})")
    if arguments.context is not None and not text:
        raise ConfigError("--context", arguments.context, "only with --dataset stdlib-text")
    if text:
        splits = stdlib_text(context=arguments.context or GPT_SIZES[model_name].positions)
    else:
        splits = resolve_dataset(arguments.dataset, "--dataset")
    if model_name == "mlp":
        features, classes = _shape_of(splits.train)
        model = mlp(features, classes, arguments.hidden)
    else:
        model = gpt(model_name)
    language_model = model_name != "mlp"
    arguments.optimizer = arguments.optimizer or ("adamw" if language_model else "sgd")
    lr, momentum, suggested_schedule = _hyperparameters(arguments, language_model)
    unbounded = not (arguments.epochs or arguments.steps)
    steps = DEFAULT_TEXT_STEPS if unbounded and text else arguments.steps
    schedule = arguments.lr_schedule or ("cosine" if language_model else suggested_schedule)
    warmup = arguments.warmup_steps
    if warmup is None:
        warmup = int(WARMUP_SHARE * (steps or 0)) if language_model and steps else 0
    job = Job(
        model=model, data=splits, optimizer=arguments.optimizer,
        momentum=momentum, batch_size=arguments.batch_size,
        epochs=DEFAULT_EPOCHS if unbounded and not text else arguments.epochs, steps=steps,
        lr=lr, seed=arguments.seed, device=arguments.device, precision=arguments.precision,
        lr_schedule=schedule, warmup_steps=warmup, compile=arguments.compile,
        eval_every=max(steps // TEXT_EVALUATIONS, 1) if text and steps else None,
    )
    settings = chosen_settings(arguments)
    prepared = job.prepare()  # refuse bad values before a cluster is started
    strategy = AUTO_START if arguments.strategy == AUTO else arguments.strategy
    validated = make_settings(strategy, {} if arguments.strategy == AUTO else settings)  # auto: its own check
    if not arguments.scheduler and arguments.workers:  # the embedded cluster's size, so the run's, is known
        cluster_module.check_local_start(arguments.workers, oversubscribe=arguments.oversubscribe)
        check_world(prepared, get_strategy(strategy), validated, arguments.workers, arguments.min_workers)
    return _with_client(arguments, lambda client: train(job, arguments.strategy, client=client,
                                                        workers=arguments.workers, run_dir=arguments.run_dir,
                                                        **fault_tolerance, **exports, **settings))


def _hyperparameters(arguments: argparse.Namespace, language_model: bool = False) -> tuple[float, float, str]:
    """The learning rate and momentum asked for, else the strategy's own defaults (Adam's lr for adam; a
    GPT's lr with AdamW, nanoGPT's for its small character-level models), and the schedule that goes with
    the strategy's SGD (constant with any other optimizer)."""
    suggested = suggested_sgd(AUTO_START if arguments.strategy == AUTO else arguments.strategy)
    if arguments.optimizer != "sgd":
        if arguments.momentum:
            raise ConfigError("--momentum", arguments.momentum, "only with --optimizer sgd",
                              f"{arguments.optimizer} keeps moment estimates of its own")
        return (arguments.lr if arguments.lr is not None else GPT_LR if language_model else ADAM_LR), 0.0, "constant"
    lr = arguments.lr if arguments.lr is not None else suggested["lr"]
    return lr, (arguments.momentum if arguments.momentum is not None else suggested["momentum"]), suggested["lr_schedule"]


ADAM_LR = 1e-3
GPT_LR = 3e-3  # AdamW on gpt-mini (nanoGPT uses 1e-3 at 10M parameters; smaller models take more)
DEFAULT_EPOCHS = 5
DEFAULT_TEXT_STEPS = 300  # stdlib-text: steps per worker unless --steps or --epochs (an epoch is ~1,340 steps on 2 workers)
WARMUP_SHARE = 0.05  # a GPT's default warm-up, as a share of the run's steps
TEXT_EVALUATIONS = 10  # stdlib-text: held-out evaluations over the run (the curve, not only the end)


def _with_client(arguments: argparse.Namespace, start: Any) -> int:
    """Connect (or start the embedded cluster), start the run with `start(client)`, follow it to its end."""
    security = tls_security(arguments)  # checked before connecting, like every other flag
    if security is not None and not arguments.scheduler:
        raise ConfigError("--tls-ca-file", arguments.tls_ca_file, "only together with --scheduler",
                          "The embedded cluster needs no certificates")
    if arguments.scheduler:
        client = cluster_module.connect(scheduler=arguments.scheduler, security=security)
        # When the scheduler goes, Dask's client logs each failed reconnection with a traceback, and its
        # batched sender a send cut mid-write ("Batched Comm Closed", at INFO with the traceback, seen once
        # in the suite); the run says what happened and how to go on, once.
        logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
        logging.getLogger("distributed.batched").setLevel(logging.WARNING)
    else:
        client = cluster_module.connect(workers=arguments.workers, dashboard_address=":0",
                                        oversubscribe=arguments.oversubscribe)
    try:
        _raise_if_interrupted()
        run = start(client)
        _follow(run, disable=arguments.no_progress)
        status = run.wait()
        result = run.evaluate()
        _print_summary(run, result, status)
        return 0
    finally:
        cluster_module.shutdown(client) if not arguments.scheduler else client.close()


# Command-line flags that are train() options for checkpoints, lost and joining workers, and the queue.
FAULT_TOLERANCE_FLAGS = ("checkpoint_every_steps", "checkpoint_every_s", "min_workers", "auto_join",
                         "collective_timeout_s", "queue")
EXPORT_FLAGS = ("tensorboard", "mlflow")  # train() options too; a resumed run keeps its exports unless given


def _follow(run: Any, disable: bool) -> None:
    said = None
    while run.status == "queued":  # on a shared cluster: say where the run stands until it starts
        waiting = run.waiting()
        if waiting is not None and waiting != said:
            print(f"workbench: run {run.run_id} {waiting}", file=sys.stderr)
            said = waiting
        _raise_if_interrupted()
        time.sleep(0.2)
    shown, decided = 0, 0
    with tqdm(total=run.total_steps, unit="step", desc=run.strategy, disable=disable, dynamic_ncols=True) as bar:
        while not run.done:
            _raise_if_interrupted()
            warnings = run.warnings()
            for text in warnings[shown:]:  # said at once, above the bar, not only in the summary
                tqdm.write(f"workbench: warning: {text}", file=sys.stderr)
            shown = len(warnings)
            decisions = run.events(kinds.AUTO_DECISION)  # strategy='auto': each choice, as it is made
            for decision in decisions[decided:]:
                tqdm.write(f"workbench: {decision['reason']}", file=sys.stderr)
            decided = len(decisions)
            done = int(run.progress() * run.total_steps)
            bar.update(done - bar.n)
            rate = run.throughput(5.0)["samples_per_s"]
            bar.set_postfix_str(f"{rate:,.0f} samples/s", refresh=False)
            time.sleep(0.2)
        bar.update(run.total_steps - bar.n if run.status == "finished" else 0)


def _print_summary(run: Any, result: dict[str, Any], status: str) -> None:
    summary = run.summary()
    print(f"run {run.run_id}: {status}, {summary.get('steps_done', 0)} steps on {summary['workers']} workers")
    print(f"strategy: {run.strategy} {run.config['settings']}")
    print(f"throughput: {summary.get('samples_per_s', 0):,.0f} samples/s in total"
          + (f", slowest worker {summary['slowest_worker']} at {summary['slowest_worker_samples_per_s']:,.0f}"
             if summary.get("workers", 0) > 1 and "slowest_worker" in summary else ""))
    split = summary.get("time_split", {})
    if split:
        print("step time: " + ", ".join(f"{k} {v:.0%}" for k, v in split.items()))
    if "staleness" in summary:
        staleness = summary["staleness"]
        print(f"staleness: mean {staleness['mean']:.2f}, max {staleness['max']} server versions")
    if "bytes_sent_per_step" in summary:
        print(f"per step: sent {summary['bytes_sent_per_step'] / 1024:,.1f} KiB, received "
              f"{summary.get('bytes_received_per_step', 0) / 1024:,.1f} KiB; communication hidden "
              f"behind compute: {summary.get('comm_hidden_fraction', 0):.0%}")
    if summary.get("link"):  # what the link alone would allow, and the share of it the run reached
        print(limit_text(summary["link"]))
    for text in summary.get("warnings", []):
        print(f"warning: {text}")
    if summary.get("deadline"):
        print(deadline.describe(summary["deadline"]))
    for entry in summary.get("recoveries", []):
        print(recovery.describe(entry))
    print(f"held-out loss: {result['loss']:.4f}")
    for key, label in (("accuracy", "accuracy"), ("bits_per_char", "bits per character"),
                       ("token_accuracy", "next-token accuracy")):
        if key in result:
            print(f"held-out {label}: {result[key]:.4f}")
    print(f"run directory: {run.directory.path}")


def _shape_of(source: Any) -> tuple[int, int]:
    """Input features and number of classes of a classification dataset, for the CLI's MLP."""
    loaded = as_source(source, "--dataset")
    loaded = loaded.load() if hasattr(loaded, "load") else loaded
    inputs, targets = loaded.batch(torch.arange(min(len(loaded), 4096)))
    return int(inputs[0].numel()), int(targets.max()) + 1


def _flag_type(convert: Any, check: Any, allowed: str) -> Any:
    """An argparse type: the text converted, then checked by the same check the Python API uses."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
            check("value", value)
        except (ValueError, ConfigError):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        return value

    return parse


_positive_int = _flag_type(int, check_positive_int, "an integer >= 1")
_positive_float = _flag_type(float, check_positive_number, "a finite number > 0")
_non_negative_int = _flag_type(int, lambda name, value: check_number(name, value, minimum=0, integer=True),
                               "an integer >= 0")
