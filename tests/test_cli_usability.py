"""What a newcomer meets first on the command line: help that names every command and shows
defaults, one clear line (no traceback) for a CUDA device that is not there, a notice when a
built-in model has random weights, a clear message for --chat without a chat template, options
named as typed (not as SamplingParams' fields), and a /metrics page without ``*_created`` series."""

from __future__ import annotations

import pytest
import torch

from vmemkv.cli import main


def test_top_level_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "serve", "ab"):
        assert command in out


@pytest.mark.parametrize("command,option,default", [
    ("generate", "--max-tokens", "64"), ("serve", "--host", "127.0.0.1"),
    ("serve", "--port", "8000"), ("generate", "--max-num-seqs", "64")])
def test_options_show_their_defaults(command, option, default, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = capsys.readouterr().out.split("\n\n", 1)[1]  # past the usage lines
    described = " ".join(options[options.index(option + " "):].split()[:30])
    assert f"(default: {default})" in described


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["ab", "--quick"]])
def test_cuda_without_cuda_is_one_line(argv, capsys):
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "Traceback" not in err


def test_random_weight_model_announces_itself(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert "random weights" in capsys.readouterr().err


def test_chat_without_a_template_says_so(capsys):
    assert main(["generate", "--model", "tiny-llama", "--chat", "--prompt", "hi"]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_model_help_names_every_built_in_model(capsys):
    from vmemkv.engine.models.zoo import BUILTIN_MODELS, REAL_MODELS

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    described = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    for name in [*REAL_MODELS, *BUILTIN_MODELS]:
        assert name in described


@pytest.mark.parametrize("argv,message", [
    (["--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--n", "0"], "--n must be >= 1")])
def test_bad_sampling_options_name_the_option(argv, message, capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_metrics_have_no_created_series():
    from vmemkv.engine.core.metrics import EngineMetrics

    metrics = EngineMetrics()
    metrics.on_request_added("r", 4)
    metrics.on_request_finished("r", "stop")
    page = metrics.render().decode()
    assert "vmemkv_" in page and "_created" not in page


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_max_model_len_past_the_models_limit_is_refused(command, capsys):
    if command == "serve":
        pytest.importorskip("fastapi", reason="serve needs fastapi (absent on the GPU image)")
    argv = ["--prompt", "hi"] if command == "generate" else ["--port", "8771"]
    assert main([command, "--model", "tiny-llama", "--threads", "1", "--max-model-len", "100000",
                 *argv]) == 2
    err = capsys.readouterr().err
    assert "limit of 32768 tokens" in err and "--allow-long-max-model-len" in err


def test_allow_long_max_model_len_lets_generate_start(capsys):
    assert main(["generate", "--model", "tiny-llama", "--threads", "1", "--max-num-seqs", "1",
                 "--max-model-len", "40000", "--allow-long-max-model-len", "--prompt", "hi",
                 "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("hi")


def test_max_model_len_help_names_the_default():
    from vmemkv.engine.core.config import DEFAULT_MAX_MODEL_LEN

    help_text = " ".join(build_help("generate").split())
    assert f"at most {DEFAULT_MAX_MODEL_LEN})" in help_text


def build_help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_max_tokens_past_max_model_len_is_refused(capsys):
    assert main(["generate", "--model", "tiny-llama", "--threads", "1", "--max-model-len", "32",
                 "--prompt", "hi", "--max-tokens", "40"]) == 2
    err = capsys.readouterr().err
    assert "maximum context length is 32 tokens" in err and "(2 in the messages, 40 in the completion)" in err


@pytest.mark.parametrize("argv,usage,hint", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "20"], "usage: vmemkv generate",
     "unrecognized arguments: --max-new-tokens 20 (did you mean --max-tokens?)"),
    (["generate", "--prompt", "hi", "--max-new-tokens=20", "--temprature", "0"], "usage: vmemkv generate",
     "(did you mean --max-tokens for --max-new-tokens, --temperature for --temprature?)"),
    (["serve", "--gpu-memory-utilization", "0.9"], "usage: vmemkv serve",
     "unrecognized arguments: --gpu-memory-utilization 0.9"),
    (["ab", "--quik"], "usage: vmemkv ab", "(did you mean --quick?)")])
def test_an_unknown_option_gets_its_commands_usage_and_the_closest_option(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err
    assert "{generate,serve,ab}" not in err  # not the top-level usage
