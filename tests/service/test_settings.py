"""Every setting is reachable by a `longdoc serve` flag and by a LONGDOC_* variable, both derived
from the Settings fields (so a field added later is reachable too), and checked on the way in."""

from __future__ import annotations

import argparse
import os
import subprocess
import typing
from pathlib import Path

import pytest

from longdoc import default_models
from longdoc.service import cli
from longdoc.service.settings import Settings, choose_default_models


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    return parser


def other_value(name: str, field) -> tuple[list[str], str, object]:
    """A value unlike the field's default: (flag arguments, variable value, expected setting)."""
    flag = cli.flag_of(name, field)
    annotation = field.annotation
    default = field.get_default(call_default_factory=True)
    kinds = {a for a in typing.get_args(annotation) if a is not type(None)} or {annotation}
    if kinds == {bool} and annotation is not bool:  # bool | None: unset by default, a flag turns it on
        return [flag], "true", True
    if annotation is bool:
        return [f"--no-{name.replace('_', '-')}" if default else flag], str(not default).lower(), not default
    if typing.get_origin(annotation) is typing.Literal:
        value = next(v for v in typing.get_args(annotation) if v != default)
        return [flag, value], value, value
    if typing.get_origin(annotation) is dict:
        return [flag, "a=b", flag, "c=d"], '{"a": "b", "c": "d"}', {"a": "b", "c": "d"}
    if name == "trusted_proxies":
        return [flag, "10.0.0.5", flag, "10.1.0.0/16"], '["10.0.0.5", "10.1.0.0/16"]', ["10.0.0.5", "10.1.0.0/16"]
    if typing.get_origin(annotation) is list:
        return [flag, "cpu", flag, "cuda:1"], '["cpu", "cuda:1"]', ["cpu", "cuda:1"]
    if Path in kinds:
        return [flag, "/run/keys"], "/run/keys", Path("/run/keys")
    if int in kinds:
        value = (default or 2) + 1
    elif float in kinds:
        value = (default or 2.0) + 0.5
    else:
        value = f"{default}x" if name != "host" else "0.0.0.0"
    return [flag, str(value)], str(value), value


def as_plain(value):
    if isinstance(value, dict):
        return {k: str(v) for k, v in value.items()}
    return value


FLAGLESS = {"api_keys"}  # secrets: a variable or a file only (a flag would show in `ps`)


def test_secrets_have_no_flag(monkeypatch):
    help_text = serve_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--api-keys" not in help_text and "--api-key-file" in help_text
    monkeypatch.setenv("LONGDOC_API_KEYS", "k1,k2")
    settings = cli.build_settings(serve_parser().parse_args(["serve", "--model", "a=/m"]))
    assert [k.get_secret_value() for k in settings.api_keys] == ["k1", "k2"]


@pytest.mark.parametrize("name", sorted(set(Settings.model_fields) - FLAGLESS))
def test_every_setting_has_a_flag_and_a_variable(name, monkeypatch):
    field = Settings.model_fields[name]
    flag_args, env_value, expected = other_value(name, field)
    parser = serve_parser()
    models = [] if name == "models" else ["--model", "a=/m"]
    settings = cli.build_settings(parser.parse_args(["serve", *models, *flag_args]))
    assert as_plain(getattr(settings, name)) == expected
    monkeypatch.setenv(f"LONGDOC_{name.upper()}", env_value)
    settings = cli.build_settings(parser.parse_args(["serve", *models]))
    assert as_plain(getattr(settings, name)) == expected
    help_text = serve_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"LONGDOC_{name.upper()})" in " ".join(help_text.split())


def test_flags_replace_variables_whole(monkeypatch):
    monkeypatch.setenv("LONGDOC_MODELS", '{"a": "/x"}')
    monkeypatch.setenv("LONGDOC_PORT", "9000")
    s = cli.build_settings(serve_parser().parse_args(["serve", "--port", "9001", "--model", "q=/m"]))
    assert (s.port, {k: str(v) for k, v in s.models.items()}) == (9001, {"q": "/m"})


def test_bad_settings_say_which_flag_and_variable():
    parser = serve_parser()
    for args, message in (
        (["--model", "nodir"], "--model 'nodir': expected NAME=DIR"),
        (["--model", "q=/a", "--model", "q=/b"], "--model 'q' given twice"),
        (["--device", "gpu7"], "--device (LONGDOC_DEVICES) ['gpu7']: device 'gpu7': expected cpu, cuda or cuda:N"),
        (["--port", "abc"], "--port (LONGDOC_PORT) 'abc': Input should be a valid integer"),
        (["--trusted-proxy", "10.0.0.300"], "--trusted-proxy (LONGDOC_TRUSTED_PROXIES) ['10.0.0.300']: '10.0.0.300' "
                                            "is not an IP address or network"),
        (["--request-timeout-s", "900"], "request_timeout_s 900.0 exceeds max_request_timeout_s 600.0"),
    ):
        models = [] if args[0] == "--model" else ["--model", "m=/m"]
        with pytest.raises(ValueError) as exc:
            cli.build_settings(parser.parse_args(["serve", *models, *args]))
        assert str(exc.value).startswith(message), str(exc.value)


def test_request_timeout_may_not_exceed_its_maximum():
    with pytest.raises(ValueError, match="exceeds max_request_timeout_s"):
        Settings(request_timeout_s=700)
    assert Settings(request_timeout_s=700, max_request_timeout_s=700).request_timeout_s == 700


def test_default_model_choice():
    tasks = {"myqa": "qa", "qa": "qa", "sum2": "summarize", "sum1": "summarize"}
    assert choose_default_models({}, tasks) == {"qa": "qa", "summarize": "sum2"}
    assert choose_default_models({"qa": "myqa", "summarize": "sum1"}, tasks) == {"qa": "myqa", "summarize": "sum1"}
    with pytest.raises(ValueError, match="--default-model qa=sum1: sum1 is a summarize model"):
        choose_default_models({"qa": "sum1"}, tasks)


def test_default_models_are_found_in_the_working_directory_then_in_longdoc_models(tmp_path, monkeypatch):
    """longdoc/default_models.py: ./models first (a clone's root, the image's /models), else the
    installed longdoc-models package; with neither, the message names ./models and how to install
    the defaults, never a path inside site-packages."""
    # a package name of its own: a clone with `pip install -e ./models` has the real longdoc_models
    monkeypatch.setattr(default_models, "PACKAGE", "longdoc_models_under_test")
    installed = tmp_path / "site-packages" / "longdoc_models_under_test"
    (installed / "qa").mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    (installed / "qa" / "manifest.json").write_text("{}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(ValueError) as exc:
        cli.build_settings(serve_parser().parse_args(["serve"]))
    assert f"under {work}/models/" in str(exc.value) and "pip install ./models" in str(exc.value)
    assert "site-packages" not in str(exc.value)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    assert cli.build_settings(serve_parser().parse_args(["serve"])).models == {"qa": installed / "qa"}
    local = work / "models" / "myqa"
    local.mkdir(parents=True)
    (local / "manifest.json").write_text("{}")
    assert cli.build_settings(serve_parser().parse_args(["serve"])).models == {"myqa": local}


def test_every_setting_has_a_description_for_its_help():
    assert [name for name, field in Settings.model_fields.items() if not field.description] == []


def test_start_up_log_names_the_folder_and_each_model_it_serves(tmp_path, tiny_qa_dir, tiny_classify_dir):
    """Issue 25, defect 3: `longdoc serve` with no --model says which models folder it serves (a
    user's ./models, not the installed longdoc-models) and every model in it; --model names each."""
    import shutil

    from tests.service.conftest import ServeProcess

    work = tmp_path / "work"
    shutil.copytree(tiny_qa_dir, work / "models" / "qa")
    shutil.copytree(tiny_classify_dir, work / "models" / "myclassify")
    with ServeProcess(["--log-level", "info", "--no-warmup"], tmp_path / "serve.log", cwd=work):
        pass
    log = (tmp_path / "serve.log").read_text()
    assert f"serving models from {work / 'models'}: myclassify, qa\n" in log, log
    with ServeProcess(["--log-level", "info", "--no-warmup", "--model", f"cls={tiny_classify_dir}"],
                      tmp_path / "serve2.log", cwd=work):
        pass
    assert f"serving models from {tiny_classify_dir.parent}: cls={tiny_classify_dir.name}\n" in (
        tmp_path / "serve2.log").read_text()


def run_serve(args: list[str], cwd) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "longdoc", "serve", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, LONGDOC_THREADS="1"))


def test_cuda_on_a_cpu_install_is_one_line_before_any_model_loads(tmp_path, tiny_qa_dir):
    """Issue 25, defect 6: `--device cuda` without onnxruntime-gpu ended in a 38-line traceback."""
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this ONNX Runtime has CUDA")
    run = run_serve(["--model", f"qa={tiny_qa_dir}", "--device", "cuda", "--port", "0"], tmp_path)
    assert run.returncode == 1
    assert run.stderr == ("longdoc serve: error: --device cuda: device='cuda' needs onnxruntime-gpu "
                          "(CUDAExecutionProvider is not available); install longdoc[gpu] instead of longdoc[serve]\n")


def test_a_port_in_use_is_reported_before_any_model_loads(tmp_path, tiny_qa_dir):
    """Issue 25, defect 6: a port in use was reported only after every model had loaded and warmed up."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_serve(["--model", f"qa={tiny_qa_dir}", "--host", "127.0.0.1", "--port", str(port),
                         "--log-level", "info"], tmp_path)
    assert run.returncode == 1
    assert f"longdoc serve: error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)\n" == run.stderr
    assert run.stdout == ""  # no model loaded, nothing logged
