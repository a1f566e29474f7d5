"""CLI error paths (one line, exit 2, no traceback) and composition of every config option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calib import config
from calib.errors import UserError


def calib_cli(*args: str, env_home=None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    if env_home is not None:
        env["CALIB_HOME"] = str(env_home)
    return subprocess.run([sys.executable, "-m", "calib", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])


def test_run_without_method_lists_methods(tmp_path):
    proc = calib_cli("run", env_home=tmp_path)
    assert_one_line_error(proc, "no method given", *config.available_methods())


def test_run_with_unknown_method_lists_methods(tmp_path):
    proc = calib_cli("run", "+method=nope", env_home=tmp_path)
    assert_one_line_error(proc, "unknown method 'nope'", *config.available_methods())


def test_unknown_override_key(tmp_path):
    method = config.available_methods()[0]
    proc = calib_cli("run", f"+method={method}", "no_such_key=1", env_home=tmp_path)
    assert_one_line_error(proc, "no_such_key")


def test_bad_value_is_rejected(tmp_path):
    method = config.available_methods()[0]
    proc = calib_cli("run", f"+method={method}", "eval.num_prompts=0", env_home=tmp_path)
    assert_one_line_error(proc, "eval.num_prompts must be >= 1")
    proc = calib_cli("run", f"+method={method}", "device=tpu", env_home=tmp_path)
    assert_one_line_error(proc, "device='tpu'")


def test_unknown_model_option_lists_models(tmp_path):
    method = config.available_methods()[0]
    proc = calib_cli("run", f"+method={method}", "model=gpt5", env_home=tmp_path)
    assert_one_line_error(proc, "gpt5", "tiny", "llama31")


def test_unknown_command():
    proc = calib_cli("frobnicate")
    assert_one_line_error(proc, "unknown command 'frobnicate'")


CALIB = Path(__file__).resolve().parents[2] / "calib"
INTERNAL_MAINS = {"calib.__main__", "calib.santa.local_worker"}  # `python -m calib` itself; a child of `run`


def user_entry_modules() -> list[str]:
    """Every ``calib`` module runnable as ``python -m`` except the internal ones."""
    found = []
    for path in sorted(CALIB.rglob("*.py")):
        if 'if __name__ == "__main__":' in path.read_text():
            found.append(".".join(path.relative_to(CALIB.parent).with_suffix("").parts))
    return [m for m in found if m not in INTERNAL_MAINS]


def test_help_lists_every_command_and_user_entry_point():
    proc = calib_cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for command in ("run", "eval", "worker", "aggregator", "ls", "promote", "ui"):
        assert f"\n  {command} " in proc.stdout, command
    modules = user_entry_modules()
    assert "calib.sampleattention.acceptance" in modules and "calib.santa.sweep" in modules
    for module in modules:
        assert f"\n  {module} " in proc.stdout, f"{module} runs as `python -m` but `calib --help` does not list it"


@pytest.mark.parametrize("module", ["calib.sampleattention.acceptance", "calib.santa.sweep"])
def test_listed_entry_points_answer_help(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    try:
        code = main(["--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code in (0, None)
    out = capsys.readouterr()
    assert out.err == "" and module.rsplit(".", 1)[1] in out.out


def test_ui_dry_run_prints_url_and_store(tmp_path):
    proc = calib_cli("ui", "--dry-run", "--port", "5123", env_home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "http://127.0.0.1:5123" in proc.stdout
    assert f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}" in proc.stdout


# ------------------------------------------------------------------ bad environment and bad paths
def test_calib_home_under_a_regular_file(tmp_path):
    (tmp_path / "afile").write_text("not a directory\n")
    for args in (["ls"], ["run", f"+method={config.available_methods()[0]}"]):
        proc = calib_cli(*args, env_home=tmp_path / "afile" / "home")
        assert_one_line_error(proc, f"CALIB_HOME={tmp_path / 'afile' / 'home'}", f"{tmp_path / 'afile'} is a file")


def test_calib_home_unwritable(tmp_path):
    """A folder without write permission; root passes permission bits, so as root a folder of procfs, which
    refuses new files to everyone."""
    locked = tmp_path / "locked"
    if os.geteuid() == 0:
        if not Path("/proc/self").is_dir():
            pytest.skip("root passes permission bits and there is no procfs to refuse a write")
        locked = Path("/proc/self")
    else:
        locked.mkdir()
        locked.chmod(0o500)
    try:
        proc = calib_cli("ls", env_home=locked / "calib-home")
    finally:
        if locked.is_relative_to(tmp_path):
            locked.chmod(0o700)
    assert_one_line_error(proc, "CALIB_HOME=", "is not writable: cannot create files in")
    assert not (locked / "calib-home").exists()


@pytest.mark.parametrize("command, below", [("worker", ""), ("aggregator", "rl")])
def test_rl_dir_that_is_a_file(tmp_path, command, below):
    """``rl.dir=/etc/passwd`` (a file) or a folder below one: refused before the model loads."""
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    rl_dir = tmp_path / "passwd" / below if below else tmp_path / "passwd"
    proc = calib_cli(command, f"rl.dir={rl_dir}", env_home=tmp_path / "home")
    assert_one_line_error(proc, f"rl.dir={rl_dir}", f"{tmp_path / 'passwd'} is a file, not a directory")


def test_ls_on_a_corrupt_tracking_store(tmp_path):
    db = tmp_path / "home" / "artifacts" / "mlflow.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(bytes(range(256)) * 64)  # 16 KiB that are no SQLite header
    before = db.read_bytes()
    proc = calib_cli("ls", env_home=tmp_path / "home")
    assert_one_line_error(proc, str(db), "not a usable SQLite database")
    assert db.read_bytes() == before  # the check only reads


def test_eval_refuses_a_method_other_than_the_artifacts(tmp_path):
    """``+method=saap`` with a SALE artifact used to evaluate SALE and exit 0; without an artifact, dense."""
    from tests.spine.helpers import write_test_artifact

    art = write_test_artifact(tmp_path / "sale")
    proc = calib_cli("eval", "+method=saap", f"artifact={art}", env_home=tmp_path / "home")
    assert_one_line_error(proc, f"{art} artifact is 'sale' but +method=saap")
    proc = calib_cli("eval", "+method=saap", env_home=tmp_path / "home")
    assert_one_line_error(proc, "+method=saap but no artifact")


@pytest.mark.slow
def test_eval_refuses_a_method_other_than_the_registered_artifacts(calib_home, tmp_path):
    """The same through the registry (``models:/sale-tiny@candidate``): refused before the model loads."""
    from calib import registry, tracking
    from tests.spine.helpers import write_test_artifact

    art = write_test_artifact(tmp_path / "sale")
    with tracking.start_run(tracking.resolve_target(), "t") as run:
        registry.publish(art, run.info.run_id)
    proc = calib_cli("eval", "+method=saap", "artifact=models:/sale-tiny@candidate", env_home=calib_home)
    assert_one_line_error(proc, "models:/sale-tiny@candidate artifact is 'sale' but +method=saap")


def test_method_override_parsing():
    assert config.method_overrides(["+method=sale", "x=1"]) == ["sale"]
    assert config.method_overrides(["method=sale,saap"]) == ["sale", "saap"]
    assert config.method_overrides(["+method=choice(sale,saap)"]) == ["sale", "saap"]
    assert config.method_overrides(["model=tiny"]) == []
    with pytest.raises(UserError):
        config.check_method_choice([])


GROUPS = ["model", "data", "tracking", "collect"]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in config.available(g)])
def test_every_group_option_composes_and_resolves(group, option):
    cfg = config.compose([f"{group}={option}"])
    OmegaConf.to_container(cfg, resolve=True)
    assert cfg[group] is not None


@pytest.mark.parametrize("method", config.available_methods())
@pytest.mark.parametrize("model", config.available("model"))
def test_every_method_composes_with_every_model(method, model):
    cfg = config.compose([f"+method={method}", f"model={model}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["method"]["name"] == method
    __import__(f"calib.{method}.recipe", fromlist=["validate"]).validate(cfg)  # every setting reads and checks


def test_eval_seed_must_differ_from_data_seed():
    cfg = config.compose(["eval.seed=5", "data.seed=5"])
    with pytest.raises(UserError, match="held out"):
        config.validate_common(cfg)
