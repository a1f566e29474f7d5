"""``python -m calib <command>``: run | eval | worker | aggregator (Hydra) and ls | promote | ui (plain).

Hydra commands are thin ``@hydra.main`` wrappers around plain functions (``calib.run.run``,
``calib.evaluate.evaluate``, ...) so tests call the functions directly. Before Hydra starts, the
overrides are checked (method choice, composition) so a user mistake ends in one line on stderr and
exit status 2 instead of a traceback. ``run``/``eval`` print one JSON object as their LAST stdout
line and also write it to ``result.json`` in the job's output directory (each job of a multirun).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from calib.errors import UserError
from calib.paths import check_home, config_dir
from runtime_kernels.errors import ArtifactError

# Each command imports its own stack where it runs (hydra, the config, tracking, the recipes): `--help`
# and the one-line errors of a mistyped command stay fast.

USAGE = """usage: python -m calib <command> [args]

commands:
  run +method=<name> [overrides]   calibrate a method, log to MLflow, register <method>-<model>
  eval [artifact=<uri|dir>] [overrides]
                                   dense vs sparse accuracy on held-out prompts
  worker [overrides]               one SANTA REINFORCE worker on rl.dir
  aggregator [overrides]           the SANTA REINFORCE aggregator on rl.dir
  ls [name-filter] [--json]        registered artifacts: version, aliases, headline and held-out eval figures
  promote <name> <version> [alias=champion] [--min-ci-low -0.05] [--strict]
                                   point an alias at a version (warns, --strict: refuses, without good held-out evals)
  ui [--port 5000] [--host 127.0.0.1] [--workers 1] [--jobs] [-- <mlflow server options>]
                                   the MLflow UI on the project's tracking store (prints the runs table URL)

method tools (python -m <module> [overrides]):
  calib.santa.sweep [sweep=1,2,4,8] [sweep_total=5,6,7]
                                   held-out reward of uniform SANTA schedules: pick a starved budget
  calib.sampleattention.acceptance artifact=<uri|dir> [--min-prompts 100] [--max-drop 0.02]
                                   per-length-bucket acceptance check of a SampleAttention artifact
"""


USER_ERRORS = (UserError, ArtifactError)  # what a user can cause: one `error:` line, exit status 2


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def emit_result(result: dict[str, Any]) -> None:
    """Write ``result.json`` into the Hydra job's output dir and print the JSON as the last line."""
    text = json.dumps(result, sort_keys=True, default=str)
    try:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir)
        (out / "result.json").write_text(text + "\n")
    except ValueError:  # not under Hydra (a plain function call)
        pass
    sys.stderr.flush()
    print(text, flush=True)


def _hydra_task(fn: Callable[[Any], dict[str, Any]]) -> Callable[[Any], None]:
    def task(cfg: Any) -> None:
        try:
            result = fn(cfg)
        except USER_ERRORS as exc:
            fail(str(exc))
            return
        if result is not None:
            emit_result(result)

    return task


def _split_flags(args: Sequence[str]) -> list[str]:
    """Overrides only (no Hydra flags such as -m, --cfg job, hydra/launcher=...)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd",
                 "--experimental-rerun", "--info", "-i"):
            skip = a not in ("--info", "-i")
            continue
        if a.startswith("-") or a.startswith("hydra.") or a.startswith("hydra/"):
            continue
        out.append(a)
    return out


def _run_hydra(cmd: str, args: list[str], fn: Callable[[Any], dict[str, Any]]) -> None:
    import hydra

    from calib.config import CONFIG_NAME

    main = hydra.main(config_path=str(config_dir()), config_name=CONFIG_NAME, version_base=None)(_hydra_task(fn))
    sys.argv = [f"calib {cmd}", *args]
    main()


def check_tracking_store(tracking_uri: str) -> None:
    """A one-line :class:`UserError` when ``tracking_uri`` is an SQLite file that SQLite cannot read
    (a corrupt or foreign file), instead of the store's traceback. Other stores are not probed."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    path = Path(tracking_uri[len("sqlite:///"):])
    if not path.exists():
        return  # a fresh store is created
    if not path.is_file():
        raise UserError(f"the tracking store {path} is not a file: move it aside or point CALIB_HOME elsewhere")
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=30)) as db:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:
        return  # locked or unreadable: left to the store, which reports it
    except sqlite3.DatabaseError as exc:
        raise UserError(f"the tracking store {path} is not a usable SQLite database ({exc}): move it aside "
                        "(a fresh one is created) or point CALIB_HOME / MLFLOW_TRACKING_URI elsewhere") from None


def check_eval_artifact_method(cfg: Any) -> None:
    """``eval``'s ``+method`` against the artifact's method (:func:`calib.registry.check_eval_method`)
    before the model loads, where the method can be told cheaply; ``evaluate`` checks the loaded one."""
    from calib import registry, tracking

    if cfg.get("method") is None:
        return
    artifact = cfg.get("artifact")
    if not artifact:
        registry.check_eval_method(cfg.method, None, None)
        return
    target = tracking.resolve_target(cfg.get("tracking"))
    if registry.parse_model_uri(artifact) is not None:
        tracking.configure(target)  # the registry lives in the project's store
    method = registry.artifact_method(artifact, target.tracking_uri)
    if method is not None:
        registry.check_eval_method(cfg.method, artifact, method)


def check_command_data(cmd: str, cfg: Any) -> None:
    """The data checks of ``run`` / ``eval`` (:mod:`calib.data.checks`), ``rl.dir`` of ``worker`` /
    ``aggregator`` and the tracking store, before Hydra starts and before any model loads: a bad JSONL
    file, a dataset missing offline or an ``rl.dir`` that is a file fails in one line."""
    from calib import tracking
    from calib.data import EVAL_NEEDS, check_data

    if cmd != "worker":  # workers never touch MLflow
        check_tracking_store(tracking.resolve_target(cfg.get("tracking")).tracking_uri)
    if cmd in ("worker", "aggregator"):
        from calib.santa.commands import settings

        settings(cfg).require_dir(cmd)
    elif cmd == "eval":
        check_data(cfg.data, EVAL_NEEDS)
        check_eval_artifact_method(cfg)
    elif cmd == "run" and cfg.get("method") is not None and "name" in cfg.method:
        try:
            recipe = importlib.import_module(f"calib.{cfg.method.name}.recipe")
        except ModuleNotFoundError:
            return  # `run` names the missing recipe
        recipe.validate(cfg)  # data_needs reads method keys: range errors first, in one line
        check_data(cfg.data, recipe.data_needs(cfg))


def cmd_hydra(cmd: str, args: list[str]) -> None:
    from calib import config

    overrides = _split_flags(args)
    if cmd == "run":
        config.check_method_choice(overrides, required="--help" not in args and "-h" not in args)
    elif cmd in ("worker", "aggregator"):
        if not config.method_overrides(overrides):
            args = [*args, "+method=santa"]
            overrides = [*overrides, "+method=santa"]
        config.check_method_choice(overrides)
    if not any(a in args for a in ("--help", "-h", "--hydra-help")):
        cfg = config.compose(overrides)
        config.validate_common(cfg)
        check_command_data(cmd, cfg)
    if cmd == "run":
        from calib.run import run as fn
    elif cmd == "eval":
        from calib.evaluate import evaluate as fn
    elif cmd == "worker":
        from calib.santa.commands import worker as fn
    else:
        from calib.santa.commands import aggregator as fn
    _run_hydra(cmd, args, fn)


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes end as one ``error:`` line (exit 2), like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")


def cmd_ls(args: list[str]) -> None:
    from calib import registry, tracking

    parser = _Parser(prog="python -m calib ls")
    parser.add_argument("name_filter", nargs="?", default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object per version")
    ns = parser.parse_args(args)
    target = tracking.resolve_target()
    check_tracking_store(target.tracking_uri)
    tracking.configure(target)
    rows = registry.list_versions(ns.name_filter)
    if ns.json:
        for r in rows:
            print(json.dumps(r.__dict__, sort_keys=True, default=str))
    elif not rows:
        print("no registered artifacts yet: run `python -m calib run +method=<name>`")
    else:
        print(registry.format_table(rows))


def cmd_promote(args: list[str]) -> None:
    from calib import registry, tracking

    usage = "usage: python -m calib promote <name> <version> [alias=champion] [--min-ci-low -0.05] [--strict]"
    parser = _Parser(prog="python -m calib promote", usage=usage.removeprefix("usage: "))
    parser.add_argument("words", nargs="*")
    parser.add_argument("--min-ci-low", type=float, default=registry.MIN_CI_LOW,
                        help="warn when the version's held-out CI lower bound of (sparse - dense) accuracy is below")
    parser.add_argument("--strict", action="store_true",
                        help="refuse instead of warning: a missing eval (pooled or on a suite of the model) or a low bound")
    ns = parser.parse_intermixed_args(args)
    positional = [a for a in ns.words if not a.startswith("alias=")]
    alias = next((a.split("=", 1)[1] for a in ns.words if a.startswith("alias=")), registry.CHAMPION)
    if len(positional) != 2 or not positional[1].isdigit() or not alias:
        raise UserError(usage)
    name, version = positional
    target = tracking.resolve_target()
    check_tracking_store(target.tracking_uri)
    tracking.configure(target)
    tags = registry.version_tags(name, version)
    warning = registry.promotion_warning(name, version, tags, ns.min_ci_low,
                                         registry.model_eval_suites(tags.get("model", "")))
    if warning and ns.strict:
        raise UserError(f"{warning}; not promoted (--strict)")
    uri = registry.promote(name, version, alias)
    print(f"{uri} -> version {version}")
    if tags.get(registry.DRY_RUN_TAG) == "true":  # champion was refused above; other aliases pass with a warning
        print(f"warning: {name} v{version} is a dry run (random weights): for measuring cost only", file=sys.stderr)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def cmd_ui(args: list[str]) -> None:
    from calib import tracking, ui

    parser = _Parser(prog="python -m calib ui")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--workers", type=int, default=1, help="server worker processes (default 1)")
    parser.add_argument("--jobs", action="store_true", help="also start MLflow's job runner (GenAI jobs)")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of starting it")
    ours, server_args = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    ns = parser.parse_args(ours)
    if ns.workers < 1:
        raise UserError(f"--workers must be >= 1 (got {ns.workers})")
    settings = ui.UiSettings(host=ns.host, port=ns.port, workers=ns.workers, jobs=ns.jobs)
    if not ui.is_loopback(ns.host):
        print(f"warning: the MLflow UI has no authentication: anyone who reaches {ns.host}:{ns.port} can read "
              "every run and move registry aliases such as champion (bind 127.0.0.1 and use an SSH tunnel)",
              file=sys.stderr, flush=True)
    target = tracking.resolve_target()
    check_tracking_store(target.tracking_uri)
    experiment_id = tracking.configure(target)
    command = ui.server_command(target.tracking_uri, target.registry_uri, target.artifact_root, settings) + server_args
    ui.save_headline_view(experiment_id)
    print(f"MLflow UI for {target.tracking_uri}: {ui.runs_table_url(ns.host, ns.port, experiment_id)}")
    print(f"  headline columns: {ui.runs_table_url(ns.host, ns.port, experiment_id, ui.HEADLINE_VIEW)}", flush=True)
    if ns.dry_run:
        print(f"{ui.JOB_EXECUTION_ENV}={str(ns.jobs).lower()} {' '.join(command)}")
        return
    code = ui.serve(command, ui.server_env(settings))
    if code != 0:
        raise UserError(f"the MLflow server exited with status {code} (is port {ns.port} free? try --port)")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    cmd, rest = args[0], args[1:]
    try:
        if cmd in ("run", "eval", "worker", "aggregator", "ls", "promote", "ui"):
            check_home()  # every command writes its store or caches under the home
        if cmd in ("run", "eval", "worker", "aggregator"):
            cmd_hydra(cmd, rest)
        elif cmd == "ls":
            cmd_ls(rest)
        elif cmd == "promote":
            cmd_promote(rest)
        elif cmd == "ui":
            cmd_ui(rest)
        else:
            raise UserError(f"unknown command {cmd!r}: one of run, eval, worker, aggregator, ls, promote, ui")
    except USER_ERRORS as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)
