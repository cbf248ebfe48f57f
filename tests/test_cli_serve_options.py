"""`vmemkv serve`'s tenant, KV-event and process-protection options: parsed, checked, passed on."""

from __future__ import annotations

import sys

import pytest

from vmemkv.cli import build_parser, engine_config_from_args, main, read_api_keys


def test_api_keys_file_skips_blanks_and_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nkey-a\n\n  key-b  \n")
    assert read_api_keys(str(path)) == ["key-a", "key-b"]
    path.write_text("# none\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(str(path))
    with pytest.raises(ValueError, match="--api-keys-file"):
        read_api_keys(str(tmp_path / "missing"))


def test_salt_per_key_without_a_key_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("VMEMKV_API_KEY", raising=False)
    assert main(["serve", "--device", "cpu", "--cache-salt-per-api-key"]) == 2
    assert "--cache-salt-per-api-key needs --api-key or --api-keys-file" in capsys.readouterr().err


def test_serve_without_the_server_packages_says_what_to_install(capsys, monkeypatch):
    # As on the GPU image, which has neither fastapi nor uvicorn.
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "vmemkv.engine.serving.server", raising=False)
    assert main(["serve", "--device", "cpu"]) == 2
    assert "vmemkv serve needs fastapi, which is not installed: python -m pip install fastapi uvicorn" \
        in capsys.readouterr().err


def test_kv_events_endpoint_reaches_the_engine_config():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--kv-events-endpoint",
                                      "tcp://*:5557"])
    assert engine_config_from_args(args).kv_events_endpoint == "tcp://*:5557"
    args = build_parser().parse_args(["generate", "--device", "cpu", "--prompt", "x"])
    assert engine_config_from_args(args).kv_events_endpoint is None


def test_a_taken_or_bad_endpoint_is_a_clear_error():
    pytest.importorskip("zmq", reason="the publisher needs pyzmq")
    pytest.importorskip("msgpack", reason="the publisher needs msgpack")
    from vmemkv.engine.serving.kv_event_publisher import KVEventPublisher

    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match="cannot bind the KV event publisher"):
            KVEventPublisher(publisher.endpoint)  # the port is taken
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher("not-an-address")
    finally:
        publisher.close()


def test_without_pyzmq_the_publisher_says_what_to_install(monkeypatch):
    from vmemkv.engine.serving.kv_event_publisher import KVEventPublisher

    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'vmemkv\[server\]'"):
        KVEventPublisher("tcp://127.0.0.1:*")


def test_protect_kv_is_on_for_serve_only_and_dumpable_turns_it_off():
    def config(*argv):
        return engine_config_from_args(build_parser().parse_args([*argv, "--device", "cpu"]))

    assert config("serve").protect_kv is True
    assert config("serve", "--dumpable").protect_kv is False
    assert config("generate", "--prompt", "x").protect_kv is False


SERVE_AND_REPORT = """
import sys
import vmemkv.engine.serving.server as server
from vmemkv.memory.protect import is_dumpable

def report(build, **options):  # instead of serving: build the engine as serve does, then report
    engine = build()
    print("dumpable" if is_dumpable() else "not dumpable", flush=True)
    engine.close()

server.run_server = report
from vmemkv.cli import main
sys.exit(main(["serve", "--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "64", *sys.argv[1:]]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_DUMPABLE) is Linux's")
@pytest.mark.parametrize("options, expected", [([], "not dumpable"), (["--dumpable"], "dumpable")])
def test_serve_makes_its_process_non_dumpable_unless_asked(options, expected):
    pytest.importorskip("uvicorn", reason="serve needs uvicorn")
    pytest.importorskip("fastapi", reason="serve needs fastapi")
    import subprocess
    run = subprocess.run([sys.executable, "-c", SERVE_AND_REPORT, *options], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected
